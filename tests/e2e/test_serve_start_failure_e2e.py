"""``stagemesh serve`` when a stage cannot load what the checks before it passed: a checkpoint whose headers are
whole but whose data is cut short (an interrupted download). The checks read headers only, so the stage finds it;
serve must then exit 2 (a model that cannot load, never retried) within seconds of the stage's failure, with the
stage's own error, and leave nothing running."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

from tests.architectures import tiny_checkpoint
from tests.conftest import free_port_base
from tests.e2e.serve_process import port_is_free, still_running

pytestmark = pytest.mark.e2e


def test_a_stage_that_cannot_read_its_weights_fails_serve_with_exit_2_and_its_error(tmp_path):
    model = tiny_checkpoint("llama", tmp_path)
    weights = os.path.join(model, "model.safetensors")
    os.truncate(weights, os.path.getsize(weights) - 4096)  # the last tensor's bytes are missing, the header is whole
    port, grpc_base, ring_base = free_port_base(1), free_port_base(1), free_port_base(2)
    process = subprocess.Popen(
        [sys.executable, "-m", "stagemesh.cli", "serve", model, "--port", str(port), "--grpc-base-port",
         str(grpc_base), "--ring-base-port", str(ring_base)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, stderr = process.communicate(timeout=180)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, 9)
    assert process.returncode == 2, stderr[-3000:]
    assert "stagemesh serve: the mesh did not start: replica 0 stage 0" in stderr, stderr[-3000:]
    # The stage's own words, through its log tail: which file, which tensor, and what is likely wrong.
    assert f"cannot read {weights}" in stderr and "incomplete download" in stderr, stderr[-3000:]
    left = _still_running(process.pid)
    assert not left, f"processes of the failed serve still running: {left}"
    assert all(port_is_free(p) for p in (port, grpc_base, ring_base, ring_base + 1))


def _still_running(session: int, settle_s: float = 10.0) -> list[int]:
    """The session's processes that still run (``still_running``: a zombie has exited) once they have had
    ``settle_s`` to exit."""
    deadline = time.monotonic() + settle_s
    while True:
        left = [p.pid for p in psutil.process_iter(["pid"]) if _session(p.pid) == session and still_running(p.pid)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def _session(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None
