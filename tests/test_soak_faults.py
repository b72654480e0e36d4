"""The soak's port block on a real loopback listener: while it holds, connections to the port get no
answer; afterwards they do, and no rule is left behind. Needs root and iptables (CI has both)."""

from __future__ import annotations

import os
import socket
import subprocess

import pytest

from stagemesh.soak.faults import PortBlock, block_available
from tests.conftest import free_port_base

available, why = block_available()
pytestmark = pytest.mark.skipif(not available, reason=f"the block fault {why}")


def _connects(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
        return True
    except OSError:
        return False


@pytest.mark.e2e  # runs iptables: a process
def test_a_blocked_port_answers_nothing_until_the_block_is_removed():
    port = free_port_base(1)
    listener = socket.create_server(("127.0.0.1", port))
    block = PortBlock("127.0.0.1", (port,))
    try:
        assert _connects(port)
        block.add()
        assert not _connects(port)
    finally:
        block.remove()
        block.remove()  # idempotent: at exit it runs again
    try:
        assert _connects(port)
        rules = subprocess.run(["iptables", "-S", "INPUT"], capture_output=True, text=True, check=True).stdout
        assert f"stagemesh-soak-{os.getpid()}" not in rules
    finally:
        listener.close()
