"""Shared test helpers: free port ranges on loopback, the default model's path."""

from __future__ import annotations

import itertools
import os
import socket

import pytest

# Each call hands out a fresh range so tests (and reruns) never share ports. The range sits
# between Ray's worker ports (10002-19999) and Linux's ephemeral ports (32768-60999), where an
# outgoing connection's TIME_WAIT could otherwise hold a port we want to bind.
_FIRST, _LAST = 22000, 32700
_NEXT_BASE = itertools.count(_FIRST + (os.getpid() % 100) * 40, 40)


def free_port_base(count: int) -> int:
    """A base port such that ``count`` consecutive loopback ports are free now."""
    for _ in range(200):
        base = next(_NEXT_BASE)
        if base + count > _LAST:
            break
        sockets = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(("127.0.0.1", port))
                sockets.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError("no free port range on loopback")


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from stage_worker.default_model import resolve_model_path

    return resolve_model_path(None)
