"""``stagemesh plan`` and ``serve --dry-run`` on this machine (no RAY_ADDRESS): the table, JSON, refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e


def _run(*args: str, memory: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "STAGEMESH_NODE_MEMORY")}
    if memory:
        env["STAGEMESH_NODE_MEMORY"] = memory
    return subprocess.run([sys.executable, "-m", "stagemesh.cli", *args], capture_output=True, text=True,
                          timeout=120, env=env)


def test_plan_prints_a_table_for_this_machine_without_starting_anything():
    done = _run("plan", "-pp", "2", "--max-model-len", "4096", memory="8GB")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "model: SmolLM2-135M-Instruct (30 layers), -pp 2 -dp 1, --max-model-len 4096"
    assert all(column in lines[1] for column in ("node", "address", "layers", "weights GB", "KV GB (tokens)",
                                                 "headroom GB"))
    assert "127.0.0.1" in lines[2] and "[0, 15) x15" in lines[2] and "[15, 30) x15" in lines[3]


def test_plan_json_gives_each_stage_its_budget_from_the_node_memory_cap():
    done = _run("plan", "-pp", "2", "-dp", "2", "--max-model-len", "1024", "--memory-fraction", "0.5", "--json",
                memory="4GB")
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert [r["replica"] for r in plan["replicas"]] == [0, 1]
    # Four stages share this machine's 4 GB: 0.5 x 4 GB / 4 each.
    assert {s["budget_bytes"] for r in plan["replicas"] for s in r["stages"]} == {500_000_000}
    assert plan["request"]["max_model_len"] == 1024


def test_an_impossible_request_exits_2_with_the_numbers_and_serve_dry_run_agrees():
    for command in ("plan", "serve"):
        args = [command, "-pp", "2", "--max-model-len", "8192"] + (["--dry-run"] if command == "serve" else [])
        done = _run(*args, memory="600MB")
        assert done.returncode == 2, done.stdout + done.stderr
        assert "not even one layer" in done.stderr and "short by" in done.stderr
        assert "budget 240 MB (--memory-fraction 0.8 x 600 MB / 2 stages)" in done.stderr


def test_assumed_nodes_plan_a_cluster_that_is_not_there():
    done = _run("plan", "--load-format", "dummy", "llama-3.1-8b", "-pp", "2", "--max-model-len", "131072",
                "--assume-node", "mac-studio=96GB", "--assume-node", "mac-mini=16GB:metal", "--json")
    assert done.returncode == 0, done.stderr
    studio, mini = json.loads(done.stdout)["replicas"][0]["stages"]
    assert (studio["node"], mini["node"]) == ("mac-studio", "mac-mini")
    assert studio["layers"][1] > 16 and mini["budget_bytes"] == int(16e9 * 0.8)
    bad = _run("plan", "--assume-node", "mac-mini=lots")
    assert bad.returncode == 2 and "--assume-node 'mac-mini=lots'" in bad.stderr
