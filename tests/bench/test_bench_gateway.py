"""``stagemesh bench-gateway`` end to end: the real gateway in its own process in front of the token
source, loaded by ``stagemesh bench``, over both stage RPCs. Checks that every request is served over
each and that the report compares them; how fast is for the benchmark's own runs, not this test."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import free_port_base

pytestmark = pytest.mark.e2e


def test_bench_gateway_serves_every_request_over_both_stage_rpcs_and_compares_them(tmp_path):
    out = tmp_path / "gateway.json"
    done = subprocess.run(
        [sys.executable, "-m", "stagemesh.cli", "bench-gateway", "--concurrency", "1,4", "--num-prompts", "8",
         "--input-len", "24", "--output-len", "8", "--step-ms", "2", "--port-base", str(free_port_base(2)),
         "--out", str(out)],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = [(r["stage_rpc"], r["concurrency"], r["failed"]) for r in report["levels"]]
    assert rows == [("stream", 1, 0), ("stream", 4, 0), ("generate", 1, 0), ("generate", 4, 0)]
    assert all(r["gateway_cpu_ms_per_token"] > 0 for r in report["levels"])
    assert [(r["concurrency"], r["stage_rpc"], r["baseline"]) for r in report["cpu_per_token_ratios"]] == \
        [(1, "generate", "stream"), (4, "generate", "stream")]


def test_bench_gateway_refuses_an_unknown_stage_rpc():
    done = subprocess.run([sys.executable, "-m", "stagemesh.cli", "bench-gateway", "--stage-rpc", "stream,unary"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--stage-rpc takes stream and/or generate" in done.stderr
