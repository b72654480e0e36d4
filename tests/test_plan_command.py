"""``stagemesh plan`` and ``serve --dry-run`` on this machine (no RAY_ADDRESS): the table, JSON, refusals.

Through the CLI's entry point in this process (``python -m stagemesh.cli`` exits with what ``main`` returns).
A plan for this machine probes its memory in a process of its own (``stage_worker.service.node_probe``), so those tests
are marked e2e; the others are not, and tests/fast_tier.py fails them if their command starts a process or Ray."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from stagemesh.cli import main


@dataclass(frozen=True)
class Done:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def _run(capsys, monkeypatch):
    def run(*args: str, memory: str | None = None) -> Done:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
        if memory:
            monkeypatch.setenv("STAGEMESH_NODE_MEMORY", memory)
        else:
            monkeypatch.delenv("STAGEMESH_NODE_MEMORY", raising=False)
        capsys.readouterr()
        code = main(list(args))
        out, err = capsys.readouterr()
        return Done(code, out, err)

    return run


@pytest.mark.e2e
def test_plan_prints_a_table_for_this_machine_without_starting_anything(_run):
    done = _run("plan", "-pp", "2", "--max-model-len", "4096", memory="8GB")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "model: SmolLM2-135M-Instruct (30 layers), -pp 2 -dp 1, --max-model-len 4096"
    assert all(column in lines[1] for column in ("node", "address", "layers", "weights GB", "KV GB (tokens)",
                                                 "headroom GB"))
    assert "127.0.0.1" in lines[2] and "[0, 15) x15" in lines[2] and "[15, 30) x15" in lines[3]


@pytest.mark.e2e
def test_plan_json_gives_each_stage_its_budget_from_the_node_memory_cap(_run):
    done = _run("plan", "-pp", "2", "-dp", "2", "--max-model-len", "1024", "--memory-fraction", "0.5", "--json",
                memory="4GB")
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert [r["replica"] for r in plan["replicas"]] == [0, 1]
    # Four stages share this machine's 4 GB: 0.5 x 4 GB / 4 each.
    assert {s["budget_bytes"] for r in plan["replicas"] for s in r["stages"]} == {500_000_000}
    assert plan["request"]["max_model_len"] == 1024


@pytest.mark.e2e
def test_an_impossible_request_exits_2_with_the_numbers_and_serve_dry_run_agrees(_run):
    for command in ("plan", "serve"):
        args = [command, "-pp", "2", "--max-model-len", "8192"] + (["--dry-run"] if command == "serve" else [])
        done = _run(*args, memory="600MB")
        assert done.returncode == 2, done.stdout + done.stderr
        assert "not even one layer" in done.stderr and "short by" in done.stderr
        assert "budget 240 MB (--memory-fraction 0.8 x 600 MB / 2 stages)" in done.stderr


def test_assumed_nodes_plan_a_cluster_that_is_not_there(_run):
    done = _run("plan", "--load-format", "dummy", "llama-3.1-8b", "-pp", "2", "--max-model-len", "131072",
                "--assume-node", "mac-studio=96GB", "--assume-node", "mac-mini=16GB:metal", "--json")
    assert done.returncode == 0, done.stderr
    studio, mini = json.loads(done.stdout)["replicas"][0]["stages"]
    assert (studio["node"], mini["node"]) == ("mac-studio", "mac-mini")
    assert studio["layers"][1] > 16 and mini["budget_bytes"] == int(16e9 * 0.8)
    bad = _run("plan", "--assume-node", "mac-mini=lots")
    assert bad.returncode == 2 and "--assume-node 'mac-mini=lots'" in bad.stderr


@pytest.mark.e2e
def test_serve_dry_run_costs_a_tp_group_over_the_link_given_and_serve_refuses_it_without(_run):
    done = _run("serve", "-tp", "2", "--dry-run", "--tp-link-latency-us", "40", memory="4GB")
    assert done.returncode == 0, done.stderr
    assert "one all-reduce of a [1, 576] float32 row 40.0 us (given: --tp-link-latency-us)" in done.stdout
    assert "all-reduces per token: 60 (2 per layer x 30 layers) = 2.40 ms" in done.stdout
    refused = _run("serve", "-tp", "2", "--tp-link-latency-us", "40", memory="4GB")
    assert refused.returncode == 2 and "use them with --dry-run" in refused.stderr
    alone = _run("serve", "--dry-run", "--tp-link-latency-us", "40", memory="4GB")
    assert alone.returncode == 2 and "plan with -tp 2 or more" in alone.stderr
