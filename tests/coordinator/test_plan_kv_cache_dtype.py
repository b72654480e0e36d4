"""The plan states ``--kv-cache-dtype`` beside the KV tokens it holds, and for q8 / q4 the context that buys
against auto on the same seats (``layer_planner.auto_kv_tokens``, the same planner over the model's facts with
KV in the compute dtype), in the table and in the JSON; ``stagemesh plan --assume-node`` prints both.

Pure functions over real model facts (the shapes' configs, dummy weights), and the CLI's entry point in this
process for ``--assume-node`` (nothing is probed, no process starts)."""

from __future__ import annotations

import json

import pytest

from coordinator.config import MeshConfig
from coordinator.layer_planner import (
    PlanRequest,
    auto_kv_tokens,
    format_plan,
    kv_cache_lines,
    largest_max_model_len,
    plan_mesh,
    plan_pipeline,
)
from stagemesh.cli import main
from stagemesh_core.kv_cache_dtype import parse_kv_cache_dtype
from tests.coordinator.test_layer_planner import LLAMA_1B, LLAMA_8B, MINI, STUDIO, cpu, seats

Q8 = parse_kv_cache_dtype("q8")
Q4 = parse_kv_cache_dtype("q4")


def _quantized_plan(facts, where, request, kv):
    return plan_mesh(facts.with_kv_cache_dtype(kv), where, PlanRequest(**{**request, "kv_cache_dtype": kv}),
                     auto_model=facts)


def test_a_quantized_plan_states_its_tokens_and_how_many_times_autos_on_the_same_seats():
    where = [seats(STUDIO, MINI)]
    auto = plan_mesh(LLAMA_8B, where, PlanRequest(32768))
    q8 = _quantized_plan(LLAMA_8B, where, {"max_model_len": 32768}, Q8)
    assert q8.auto_kv_tokens == (auto.replica_kv_tokens(0),)
    tokens, base = q8.replica_kv_tokens(0), auto.replica_kv_tokens(0)
    assert q8.kv_gain(0) == tokens / base
    # float16 keys and values (2 bytes an element) against 8-bit codes plus a float16 scale and bias per 64:
    # the room left for KV is the same, so the tokens grow by the bytes' ratio (within the planner's rounding).
    assert q8.kv_gain(0) == pytest.approx(2 / (1 + 2 * 2 / 64), rel=0.02)
    line = f"KV cache: q8 (8-bit, group 64): {tokens:,} tokens, {tokens / base:.2f}x of auto ({base:,} tokens)"
    assert kv_cache_lines(q8) == [line]
    assert line in format_plan(q8).splitlines()
    assert "KV cache: auto (keys and values in float16): " + f"{base:,} tokens" in format_plan(auto)


def test_the_json_carries_the_dtype_and_autos_tokens():
    q4 = _quantized_plan(LLAMA_1B, [seats(MINI)], {"max_model_len": 8192}, Q4)
    document = q4.to_json()
    assert document["kv_cache_dtype"] == {"name": "q4", "bits": 4, "group_size": 64}
    (replica,) = document["replicas"]
    assert replica["auto_kv_tokens"] == q4.auto_kv_tokens[0] and replica["kv_tokens_vs_auto"] == q4.kv_gain(0)
    assert replica["kv_tokens_vs_auto"] > 3
    auto = plan_mesh(LLAMA_1B, [seats(MINI)], PlanRequest(8192)).to_json()
    assert auto["kv_cache_dtype"]["name"] == "auto" and "auto_kv_tokens" not in auto["replicas"][0]


def test_a_context_only_quantized_kv_fits_says_auto_does_not():
    node = [seats(cpu(8))]
    longest = largest_max_model_len(LLAMA_1B, node[0], PlanRequest(10**8))  # searched up to its max_model_len
    q4 = _quantized_plan(LLAMA_1B, node, {"max_model_len": 2 * longest}, Q4)
    assert q4.auto_kv_tokens == (None,) and q4.kv_gain(0) is None
    assert auto_kv_tokens(LLAMA_1B, node[0], PlanRequest(2 * longest, kv_cache_dtype=Q4)) is None
    assert kv_cache_lines(q4) == [f"KV cache: q4 (4-bit, group 64): {q4.replica_kv_tokens(0):,} tokens "
                                  "(auto does not fit these stages)"]


def test_replicas_on_different_nodes_each_state_their_own():
    plan = _quantized_plan(LLAMA_1B, [seats(STUDIO), seats(MINI)], {"max_model_len": 8192}, Q8)
    (line,) = kv_cache_lines(plan)
    assert line.startswith("KV cache: q8 (8-bit, group 64): replica 0 ") and "; replica 1 " in line
    same = _quantized_plan(LLAMA_1B, [seats(MINI), seats(MINI)], {"max_model_len": 8192}, Q8)
    assert kv_cache_lines(same)[0].endswith(" tokens) per replica")


def test_mesh_config_plans_kv_as_the_flag_stores_it_and_compares_with_auto():
    config = MeshConfig("m", "m", 16, tensor_parallel_size=2, kv_cache_dtype=Q8, model_facts=LLAMA_1B)
    # Quantized before the worker's share, as each worker's stage counts it.
    assert config.planned_facts() == LLAMA_1B.with_kv_cache_dtype(Q8).worker_share(2)
    assert config.auto_kv_facts() == LLAMA_1B.worker_share(2)
    assert config.plan_request().kv_cache_dtype == Q8
    plain = MeshConfig("m", "m", 16, model_facts=LLAMA_1B)
    assert plain.auto_kv_facts() is None and plain.planned_facts() == LLAMA_1B
    (q8,), _ = plan_pipeline(config.planned_facts(), seats(MINI), config.plan_request())
    (auto,), _ = plan_pipeline(config.auto_kv_facts(), seats(MINI), plain.plan_request())
    assert q8.kv_tokens > auto.kv_tokens


def test_plan_with_assumed_nodes_prints_the_kv_dtype_and_its_gain(capsys, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    command = ["plan", "--load-format", "dummy", "llama-3.1-8b", "--max-model-len", "32768",
               "--assume-node", "mac-studio=96GB", "--kv-cache-dtype", "q8"]
    capsys.readouterr()
    assert main(command) == 0
    table = capsys.readouterr().out
    (line,) = [line for line in table.splitlines() if line.startswith("KV cache: ")]
    assert line.startswith("KV cache: q8 (8-bit, group 64): ") and "x of auto (" in line
    assert main([*command, "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["kv_cache_dtype"]["name"] == "q8"
    (replica,) = document["replicas"]
    assert f"{replica['kv_tokens']:,} tokens, {replica['kv_tokens_vs_auto']:.2f}x of auto" in line
