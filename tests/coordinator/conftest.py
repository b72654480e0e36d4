"""Helpers for coordinator tests: port ranges safe from Ray, the fake stage."""

from __future__ import annotations

import itertools
import os
import socket
from pathlib import Path

import pytest

FAKE_STAGE = (str(Path(__file__).with_name("fake_stage.py")),)

# Below Linux's ephemeral range (32768+), where Ray's many outgoing connections
# pick source ports that can hold a chosen port in TIME_WAIT, and above Ray's
# worker ports (10002-19999).
_NEXT = itertools.count(20000 + (os.getpid() % 100) * 120, 24)


def free_port_range(count: int) -> int:
    """A base such that ``count`` consecutive loopback ports are bindable now."""
    for _ in range(400):
        base = next(_NEXT)
        if base + count > 32700:
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
    raise RuntimeError("no free port range on loopback below 32700")


def mesh_ports(total_stages: int) -> tuple[int, int]:
    """(ring_base, grpc_base) for a mesh of ``total_stages``, disjoint and free."""
    base = free_port_range(3 * total_stages)
    return base, base + 2 * total_stages


@pytest.fixture
def fake_stage_command() -> tuple[str, ...]:
    return FAKE_STAGE
