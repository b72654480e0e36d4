"""``stagemesh bench-gateway`` end to end: the real gateway in its own process in front of the token
source, loaded by ``stagemesh bench``. Checks that every request is served and the gateway's cost is
reported per level; how fast is for the benchmark's own runs, not this test."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import free_port_base


def test_bench_gateway_serves_every_request_and_reports_the_gateway_cost_per_level(tmp_path):
    out = tmp_path / "gateway.json"
    done = subprocess.run(
        [sys.executable, "-m", "stagemesh.cli", "bench-gateway", "--concurrency", "1,4", "--num-prompts", "8",
         "--input-len", "24", "--output-len", "8", "--step-ms", "2", "--port-base", str(free_port_base(2)),
         "--out", str(out)],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [(r["concurrency"], r["failed"]) for r in report["levels"]] == [(1, 0), (4, 0)]
    assert all(r["gateway_cpu_ms_per_token"] > 0 for r in report["levels"])


def test_bench_gateway_refuses_a_concurrency_below_one():
    done = subprocess.run([sys.executable, "-m", "stagemesh.cli", "bench-gateway", "--concurrency", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--concurrency takes positive integers" in done.stderr
