"""``stagemesh bench gateway`` end to end: the real gateway in its own process in front of the token
source, loaded by ``stagemesh bench serve``. Checks that every request is served at each level and that the
report gives the delivered rate over the offered one; how fast is for the benchmark's own runs, not this test."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import free_port_base

pytestmark = pytest.mark.e2e  # it starts the gateway, a token source and the load in their own processes


def test_bench_gateway_serves_every_request_at_each_level_and_reports_the_gateways_cpu(tmp_path):
    out = tmp_path / "gateway.json"
    done = subprocess.run(
        [sys.executable, "-m", "stagemesh.cli", "bench", "gateway", "--concurrency", "1,4", "--num-prompts", "8",
         "--input-len", "24", "--output-len", "8", "--step-ms", "2", "--port-base", str(free_port_base(2)),
         "--output", str(out)],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["kind"] == "gateway"
    levels = report["results"]["levels"]
    assert [(r["concurrency"], r["failed"]) for r in levels] == [(1, 0), (4, 0)]
    assert all(r["gateway_cpu_ms_per_token"] > 0 for r in levels)
    assert [(r["concurrency"], r["compares"]) for r in report["ratios"]] == \
        [(1, "delivered / offered tokens per second"), (4, "delivered / offered tokens per second")]
    assert all(r["value"] > 0 for r in report["ratios"])
    assert "offered tok/s" in done.stdout  # the table
