"""``stagemesh soak`` for a short while in CI: PP=2 on the default model, 4 streaming clients (mixed
lengths, abandoned streams, bad input), a stage killed with SIGKILL and one frozen with SIGSTOP. The run
must pass its own verdict: requests served, none hung, failures only in a fault's window and each with
its error, every fault recovered, the gateway's memory and descriptors flat."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import free_port_base

pytestmark = pytest.mark.e2e


def test_a_short_soak_with_a_kill_and_a_freeze_passes(tmp_path):
    # Seed 3 draws the freeze first, which is over when --hold ends, so the kill follows well within the 30 s of
    # load; one of each is all the verdict below needs (a longer run only repeats them).
    report_path = tmp_path / "soak.json"
    done = subprocess.run(
        [sys.executable, "-m", "stagemesh.soak", "--duration", "20", "--streams", "2", "-pp", "2", "--warmup", "5",
         "--faults", "kill,stop", "--hold", "5", "--fault-interval", "3", "--allow-give-up", "--seed", "3",
         "--port", str(free_port_base(1)), "--grpc-base-port", str(free_port_base(2)),
         "--ring-base-port", str(free_port_base(4)), "--json", str(report_path), "--log-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600)
    assert report_path.exists(), done.stdout + done.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert done.returncode == 0 and report["passed"], done.stdout + done.stderr[-3000:]
    assert report["requests"]["ok"] > 0 and report["hung"] == 0 and not report["failures_unexcused"]
    assert {f["kind"] for f in report["faults"]} == {"kill", "stop"}
    assert all(f["recovery_s"] is not None for f in report["faults"])
    assert all(failure["error"] for failure in report["failures_excused"])
    assert {r["name"] for r in report["resources"]} >= {"gateway", "replica 0 stage 0", "replica 0 stage 1"}
