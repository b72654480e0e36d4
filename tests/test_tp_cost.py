"""The -tp cost model, pure: all-reduces per token, what -tp saves, the verdict against -pp and its bounds, sources
named, doctor's report read back, and the plan's comparison over a planned mesh."""

from __future__ import annotations

import pytest

from stagemesh_core.errors import UserError
from stagemesh_core.tp_cost import (
    Figure,
    GroupStage,
    LinkFigures,
    allreduces_per_layer,
    assumed_link,
    compare_tp_pp,
    format_comparison,
    given_link,
    link_from_doctor,
    published_bandwidth,
    stage_saving_us,
)

GB = 10**9


def measured(value: float) -> Figure:
    return Figure(value, "measured", "a test's link")


def stage(layers: int = 30, gb: float = 1.0, gbs: float | None = 100.0, one_node: bool = False) -> GroupStage:
    return GroupStage(layers, int(gb * GB), measured(gbs) if gbs else None, one_node)


def test_all_reduces_per_layer_dense_and_moe_are_two_and_minimax_sums_its_norms_too():
    for model_type in ("llama", "qwen2", "qwen3", "qwen3_moe", "gpt_oss", "deepseek_v3", None):
        assert allreduces_per_layer(model_type) == 2
    assert allreduces_per_layer("minimax") == 4


def test_weights_saved_per_token_at_the_nodes_bandwidth():
    # 1 GB per token at 100 GB/s is 10 ms; -tp 2 reads half on each node at once: 5 ms saved.
    assert stage_saving_us(stage(), 2) == pytest.approx(5000.0)
    assert stage_saving_us(stage(), 4) == pytest.approx(7500.0)
    assert stage_saving_us(stage(one_node=True), 2) == 0.0  # one memory for both workers
    assert stage_saving_us(stage(gbs=None), 2) is None


def test_a_fast_link_makes_tp_faster_and_a_slow_one_slower_with_the_margin():
    fast = compare_tp_pp([stage()], 2, LinkFigures("jaccl", measured(30.0), hop_us=measured(20.0)))
    assert fast.allreduces_per_token == 60 and fast.allreduce_us_per_token == pytest.approx(1800.0)
    assert fast.extra_hops == 1
    assert fast.verdict == "tp" and fast.margin_us_per_token == pytest.approx(5000 + 20 - 1800)
    slow = compare_tp_pp([stage()], 2, LinkFigures("ring", measured(300.0), hop_us=measured(150.0)))
    assert slow.verdict == "pp" and slow.margin_us_per_token == pytest.approx(5000 + 150 - 18000)


def test_pipeline_of_groups_counts_every_stage_and_its_hops():
    # -pp 2 -tp 2 against -pp 4: 2 x 2 extra hops; all-reduces over both stages' layers.
    c = compare_tp_pp([stage(10), stage(20, gb=2.0)], 2, LinkFigures("ring", measured(100.0), measured(50.0)))
    assert c.pipeline_parallel_size == 2 and c.extra_hops == 2 and c.allreduces_per_token == 60
    assert c.weights_saved_us_per_token == pytest.approx(5000 + 10000)
    assert c.verdict == "tp" and c.margin_us_per_token == pytest.approx(15000 + 100 - 6000)


def test_an_unmeasured_hop_is_bounded_by_the_all_reduce():
    # Saved 5 ms + at most 1 hop of 300 us < 18 ms of all-reduces: -pp wins whatever the hop.
    c = compare_tp_pp([stage()], 2, LinkFigures("ring", measured(300.0)))
    assert c.verdict == "pp" and c.hop_us is None and c.hop_bound_us == 300.0 and c.margin_us_per_token is None
    # The weights alone repay the all-reduces: -tp wins whatever the hop.
    assert compare_tp_pp([stage()], 2, LinkFigures("jaccl", measured(30.0))).verdict == "tp"


def test_a_missing_bandwidth_or_latency_gives_unknown_naming_what_to_give():
    c = compare_tp_pp([stage(gbs=None)], 2, LinkFigures("ring", measured(100.0)))
    assert c.verdict == "unknown" and c.weights_saved_us_per_token is None
    assert any("memory bandwidth" in m for m in c.missing)
    nccl = compare_tp_pp([stage()], 2, assumed_link("nccl"))
    assert nccl.verdict == "unknown" and nccl.allreduce_us_per_token is None
    assert any("--tp-link-latency-us" in m for m in nccl.missing)


def test_one_node_groups_save_nothing_so_tp_loses_to_its_all_reduces():
    c = compare_tp_pp([stage(one_node=True)], 2, LinkFigures("ring", measured(70.0), measured(30.0)))
    assert c.weights_saved_us_per_token == 0.0 and c.verdict == "pp"


def test_figures_name_their_source_and_refuse_nonsense():
    link = assumed_link("ring")
    assert link.allreduce_us is not None and link.allreduce_us.source == "assumed" and link.allreduce_us.detail
    assert given_link("ring", 42.0).allreduce_us == Figure(42.0, "given", "--tp-link-latency-us")
    with pytest.raises(UserError, match="positive"):
        given_link("ring", 0)
    with pytest.raises(ValueError, match="source"):
        Figure(1.0, "guessed", "nowhere")
    with pytest.raises(ValueError):
        compare_tp_pp([stage()], 1, link)


def test_published_bandwidth_from_the_device_name():
    assert published_bandwidth("Apple M2 Max").value == 400.0
    assert published_bandwidth("Apple M2").value == 100.0
    assert published_bandwidth("Apple M4 Pro").source == "published"
    assert published_bandwidth("NVIDIA H100 PCIe").value == 2000.0
    assert published_bandwidth("NVIDIA H100 80GB HBM3").value == 3350.0
    assert published_bandwidth("AMD EPYC") is None and published_bandwidth(None) is None


def _doctor_report() -> dict:
    return {"mode": "local", "ok": True, "tp_link": {
        "mode": "local", "backend": "ring", "hosts": ["10.0.0.1", "10.0.0.2"], "hidden_size": 576, "dtype": "float16",
        "prefill_rows": 512, "measured_at": "2026-12-07T00:00:00+00:00",
        "allreduce_us": {"decode": {"median": 80.0, "p10": 70.0, "p90": 95.0, "samples": 200},
                         "prefill": {"median": 900.0, "p10": 800.0, "p90": 1000.0, "samples": 20}},
        "hop_us": {"median": 40.0, "p10": 35.0, "p90": 50.0, "samples": 200},
        "memory_bandwidth_gbs": [350.0, 300.0]}}


def test_doctor_report_read_back_as_measured_figures():
    link = link_from_doctor(_doctor_report())
    assert link.backend == "ring" and link.allreduce_us == Figure(80.0, "measured", link.allreduce_us.detail)
    assert "10.0.0.1 and 10.0.0.2" in link.allreduce_us.detail
    assert link.hop_us.value == 40.0 and link.bandwidth_gbs.value == 300.0  # the slower node
    assert link.prefill_allreduce_us.value == 900.0 and link.prefill_rows == 512 and link.hidden_size == 576
    with pytest.raises(UserError, match="stagemesh doctor --tp-link --json"):
        link_from_doctor({"mode": "local", "findings": []}, "link.json")
    with pytest.raises(UserError, match="failed"):
        link_from_doctor({"tp_link": {"error": "ports in use", "allreduce_us": None}})


def test_the_plans_lines_say_cost_source_and_verdict():
    link = link_from_doctor(_doctor_report())
    stages = [GroupStage(30, 4 * GB, link.bandwidth_gbs, False)]  # 4 GB at 300 GB/s: 6.67 ms saved at -tp 2
    c = compare_tp_pp(stages, 2, link)
    text = "\n".join(format_comparison(c, link, stages, 576, "float16"))
    assert "all-reduces per token: 60 (2 per layer x 30 layers) = 4.80 ms" in text
    assert "measured: stagemesh doctor --tp-link between 10.0.0.1 and 10.0.0.2" in text
    assert "expected: -tp 2 faster than -pp 2 for one stream by 1.91 ms per token" in text
    assumed = assumed_link("ring")
    c = compare_tp_pp([stage(one_node=True)], 2, assumed)
    text = "\n".join(format_comparison(c, assumed, [stage(one_node=True)], 576, "float32"))
    assert "assumed:" in text and "that latency is an assumption" in text and "SLOWER than -pp 2" in text
    other = "\n".join(format_comparison(compare_tp_pp(stages, 2, link), link, stages, 2048, "bfloat16"))
    assert "--hidden-size 2048" in other and "--dtype bfloat16" in other


def test_plan_comparison_over_a_planned_mesh():
    """stagemesh.plan_report.tp_comparison on the planner's own plan for assumed nodes (no process)."""
    from coordinator.config import MeshConfig
    from coordinator.layer_planner import PlanRequest, StageSeat, plan_mesh
    from coordinator.plan_preview import assumed_preview
    from stagemesh.plan_report import assumed_nodes, tp_comparison
    from stagemesh_core.memory import ModelFacts, NodeMemory, TensorBytes

    facts = ModelFacts(num_layers=32, layer=TensorBytes(0, 200_000_000), embedding=TensorBytes(0, 500_000_000),
                       head=TensorBytes(0, 500_000_000), kv_elements_per_token=2048)
    config = MeshConfig(model_path="m", served_model_name="m", num_layers=32, pipeline_parallel_size=2,
                        tensor_parallel_size=2, model_facts=facts, max_model_len=4096, compute_dtype="float16")
    shown = assumed_preview(config, assumed_nodes(["a=64GB", "b=64GB"]))
    # Serve's placement: each stage's two workers on the two nodes, so each node holds two workers, and each
    # stage is planned with a worker's share of the model, not the whole model.
    assert shown.one_node == ((False, False),)
    plan = shown.plan
    seats = [[StageSeat(node, node, NodeMemory("metal", "assumed", 64 * 10**9, 64 * 10**9, 64 * 10**9, 64 * 10**9),
                        2, node) for node in ("a", "b")]]
    assert plan == plan_mesh(facts.worker_share(2), seats, PlanRequest(max_model_len=4096, compute_dtype="float16"))
    link = LinkFigures("jaccl", measured(30.0), hop_us=measured(25.0), bandwidth_gbs=measured(400.0))
    (group, c), = tp_comparison(plan, facts, 2, link, (("Apple M2 Max", "Apple M2 Max"),), ((False, False),))
    assert [g.layers for g in group] == [len(s.layers) for s in plan.replicas[0]]
    # float16: 2 bytes per element; the last stage also reads the head, the first not the embedding.
    assert sum(g.streamed_bytes for g in group) == (32 * 200_000_000 + 500_000_000) * 2
    assert c.allreduces_per_token == 64 and c.extra_hops == 2 and c.verdict == "tp"
