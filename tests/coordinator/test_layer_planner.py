"""The layer planner over a table of clusters and models: plain values, no Ray, no MLX.

Models are the shipped shapes (Llama 3.1 8B: untied head; Llama 3.2 1B: tied)
sized by ``stage_worker.model.model_facts`` exactly as ``serve`` sizes them; nodes are
``NodeMemory`` values as a StageHost would report them.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from coordinator.layer_planner import (
    HEADROOM_FRACTION,
    PlanError,
    PlanRequest,
    StageSeat,
    format_plan,
    largest_max_model_len,
    plan_mesh,
    plan_pipeline,
)
from stage_worker.checkpoint.model_reader import read_model_spec
from stage_worker.model.model_facts import model_facts
from stage_worker.service.memory import MemoryBudget, kv_token_capacity
from stagemesh.bench.random_checkpoint import SHAPES_DIR
from stagemesh_core.layer_split import LayerRange
from stagemesh_core.memory import (
    RUNTIME_OVERHEAD_BYTES,
    DraftFacts,
    LayerKV,
    ModelFacts,
    NodeMemory,
    TensorBytes,
    draft_kv_columns,
)

GB = 10**9


def facts(shape: str):
    return model_facts(read_model_spec(str(SHAPES_DIR / shape), "dummy"))


LLAMA_8B = facts("llama-3.1-8b")  # 32 layers, untied head
LLAMA_1B = facts("llama-3.2-1b")  # 16 layers, tied embeddings


def mac(ram_gb: float, working_set_gb: float, speed: float = 1.0) -> NodeMemory:
    """A Mac as its StageHost reports it: Metal, the recommended working set as the GPU's memory."""
    return NodeMemory("metal", "Apple M", int(ram_gb * GB), int(ram_gb * GB * 0.9), int(working_set_gb * GB),
                      speed=speed)


def cpu(gb: float) -> NodeMemory:
    return NodeMemory("cpu", "x86", int(gb * GB), int(gb * GB))


STUDIO = mac(128, 96)
MINI = mac(24, 16)


def seats(*memories: NodeMemory, sharing: int = 1) -> list[StageSeat]:
    return [StageSeat(f"node{i}", f"10.0.0.{i + 1}", m, sharing, f"mac{i}") for i, m in enumerate(memories)]


def layers(stages) -> list[int]:
    return [len(s.layers) for s in stages]


def test_equal_nodes_with_room_split_evenly():
    stages, chosen_by = plan_pipeline(LLAMA_8B, seats(STUDIO, STUDIO), PlanRequest(8192))
    assert [s.layers for s in stages] == [LayerRange(0, 16), LayerRange(16, 32)]
    assert chosen_by == "memory planner"
    stages, _ = plan_pipeline(LLAMA_1B, seats(STUDIO, STUDIO, STUDIO, STUDIO), PlanRequest(8192))
    assert sorted(layers(stages)) == [4, 4, 4, 4]


@pytest.mark.parametrize("max_model_len", [8192, 32768, 65536, 131072])
def test_uneven_pair_every_stage_fits_with_headroom(max_model_len):
    stages, _ = plan_pipeline(LLAMA_8B, seats(STUDIO, MINI), PlanRequest(max_model_len, memory_fraction=0.8))
    assert sum(layers(stages)) == 32 and stages[0].layers.start == 0 and stages[-1].layers.end == 32
    for stage in stages:
        assert stage.headroom_bytes >= HEADROOM_FRACTION * stage.budget_bytes
        assert stage.kv_tokens >= max_model_len  # one full-length sequence at least
    # The stage's own rule accepts it and computes the same KV capacity.
    small = stages[1]
    budget = MemoryBudget(16 * GB, 16 * GB, 0.8, 1, "GPU")
    kv = LLAMA_8B.slice_kv(small.layers.start, small.layers.end)
    assert kv_token_capacity(budget, small.weight_bytes, kv, 2, 64, max_model_len, "s") == small.kv_tokens


def test_long_contexts_where_kv_dominates_move_layers_to_the_big_node():
    short, _ = plan_pipeline(LLAMA_8B, seats(STUDIO, MINI), PlanRequest(8192))
    long, _ = plan_pipeline(LLAMA_8B, seats(STUDIO, MINI), PlanRequest(131072))
    assert layers(short) == [16, 16]  # the even split fits the mini at 8k
    assert layers(long)[0] > 16 > layers(long)[1]  # at 128k the mini's KV for 16 layers would not fit
    # Its KV (at 131072 tokens x 1/2 MB per token per 16 layers) outweighs its weights.
    assert long[1].kv_bytes > long[1].weight_bytes


def test_a_faster_node_gets_more_layers_when_memory_allows():
    stages, _ = plan_pipeline(LLAMA_8B, seats(mac(128, 96, speed=3), mac(128, 96, speed=1)), PlanRequest(8192))
    assert layers(stages) == [24, 8]  # times 24/3 = 8 and 8/1 = 8: the slowest stage is as fast as it gets


def test_tied_and_untied_heads_are_counted_where_they_live():
    element = 2  # float16 on Metal
    for model in (LLAMA_8B, LLAMA_1B):
        one, _ = plan_pipeline(model, seats(STUDIO), PlanRequest(4096))
        two, _ = plan_pipeline(model, seats(STUDIO, STUDIO), PlanRequest(4096))
        layer = model.layer.nbytes(element)
        embedding, head = model.embedding.nbytes(element), model.head.nbytes(element)
        assert two[0].weight_bytes == len(two[0].layers) * layer + embedding
        assert two[1].weight_bytes == len(two[1].layers) * layer + head
        if model.tied_embeddings:  # a lone stage holds the tied matrix once: only the final norm is extra
            assert one[0].weight_bytes == model.num_layers * layer + embedding + (head - embedding)
        else:
            assert one[0].weight_bytes == model.num_layers * layer + embedding + head
    assert LLAMA_1B.tied_embeddings and not LLAMA_8B.tied_embeddings


def test_a_node_too_small_for_even_one_layer_is_named_with_its_shortfall():
    with pytest.raises(PlanError) as refused:
        plan_pipeline(LLAMA_8B, seats(STUDIO, cpu(0.5)), PlanRequest(8192))
    message = str(refused.value)
    assert "stage 1 on mac1 (10.0.0.2, cpu): budget 400 MB" in message
    assert "not even one layer" in message and "short by" in message
    assert "leave mac1 out" in message and "set --pipeline-parallel-size 1" in message


def test_an_impossible_request_says_the_longest_context_and_how_many_more_nodes():
    request = PlanRequest(131072, memory_fraction=0.8)
    three_minis = seats(MINI, MINI, MINI)
    with pytest.raises(PlanError) as refused:
        plan_pipeline(LLAMA_8B, three_minis, request)
    message = str(refused.value)
    assert "do not fit replica 0's 3 stage(s)" in message and "short by about" in message
    longest = largest_max_model_len(LLAMA_8B, three_minis, request)
    assert f"lower --max-model-len to {longest} or less" in message
    plan_pipeline(LLAMA_8B, three_minis, PlanRequest(longest))  # fits
    with pytest.raises(PlanError):
        plan_pipeline(LLAMA_8B, three_minis, PlanRequest(longest + 1))
    # The way out it names works: that many more nodes of that size.
    assert "add 1 more node(s) with 16.00 GB usable like mac0" in message
    assert "--pipeline-parallel-size 4" in message
    plan_pipeline(LLAMA_8B, seats(MINI, MINI, MINI, MINI), request)


def test_dp_by_pp_replicas_sharing_nodes_split_their_memory():
    # Two replicas x two stages on two nodes: each node hosts two stages, each with half its budget.
    alone, _ = plan_pipeline(LLAMA_8B, seats(STUDIO, MINI), PlanRequest(32768))
    plan = plan_mesh(LLAMA_8B, [seats(STUDIO, MINI, sharing=2), seats(STUDIO, MINI, sharing=2)],
                     PlanRequest(32768))
    assert len(plan.replicas) == 2 and plan.ranges(0) == plan.ranges(1)
    assert plan.replicas[0][1].budget_bytes == alone[1].budget_bytes // 2
    assert layers(plan.replicas[0])[1] < layers(alone)[1]  # half the mini holds fewer layers
    assert [s.replica for s in plan.replicas[1]] == [1, 1]


def test_an_explicit_split_is_kept_when_it_fits_and_refused_with_numbers_when_not():
    stages, chosen_by = plan_pipeline(LLAMA_8B, seats(STUDIO, MINI), PlanRequest(8192, layer_split="20"))
    assert layers(stages) == [20, 12] and chosen_by == "--pp-layer-split"
    with pytest.raises(PlanError) as refused:
        plan_pipeline(LLAMA_8B, seats(STUDIO, MINI), PlanRequest(131072, layer_split="16"))
    message = str(refused.value)
    assert "--pp-layer-split 16 does not fit replica 0" in message
    assert "stage 1 on mac1 (10.0.0.2, metal): budget 12.80 GB" in message and "short by" in message
    chosen, _ = plan_pipeline(LLAMA_8B, seats(STUDIO, MINI), PlanRequest(131072))
    assert f"the planner chooses --pp-layer-split {chosen[1].layers.start}" in message


def test_more_stages_than_layers_names_the_flag():
    with pytest.raises(ValueError, match="--pipeline-parallel-size 17 exceeds the model's 16"):
        plan_pipeline(LLAMA_1B, seats(*[STUDIO] * 17), PlanRequest(1024))


def test_the_table_and_json_carry_each_stages_numbers():
    plan = plan_mesh(LLAMA_8B, [seats(STUDIO, MINI)], PlanRequest(131072, max_num_seqs=8))
    table = format_plan(plan)
    header, first, second = table.splitlines()[:3]
    for column in ("node", "address", "layers", "weights GB", "KV GB (tokens)", "headroom GB"):
        assert column in header
    assert "mac0" in first and "10.0.0.1" in first and "metal float16" in first and "[0, " in first
    assert f"({plan.replicas[0][1].kv_tokens})" in second
    assert f"replica 0: KV for {plan.replica_kv_tokens(0)} tokens" in table
    document = plan.to_json()
    stage = document["replicas"][0]["stages"][1]
    assert stage["address"] == "10.0.0.2" and stage["layers"][1] == 32
    assert stage["kv_tokens"] == plan.replicas[0][1].kv_tokens
    assert document["replicas"][0]["kv_tokens"] == min(s.kv_tokens for s in plan.replicas[0])


def test_node_memory_cap_and_runtime_allowance_shape_the_budget():
    capped = NodeMemory("cpu", "x86", 64 * GB, 60 * GB, cap=4 * GB)
    assert capped.budget(0.5, 1).budget_bytes == 2 * GB
    assert capped.usable_bytes() == 4 * GB
    (stage,), _ = plan_pipeline(LLAMA_1B, [StageSeat("n", "h", capped)], PlanRequest(64, memory_fraction=1.0,
                                                                                    compute_dtype="float16"))
    assert stage.kv_tokens == (4 * GB - stage.weight_bytes - RUNTIME_OVERHEAD_BYTES) // stage.kv_bytes_per_token


# -- models whose layers differ: plain facts -------------------------------------------------------

def layered(sizes_gb: list[float], kv_layers=(), per_token: int = 1024) -> ModelFacts:
    """A model of ``sizes_gb`` layers (quantized bytes, whatever the dtype) with a 0.1 GB embedding and head."""
    sizes = tuple(TensorBytes(packed=int(gb * GB)) for gb in sizes_gb)
    return ModelFacts(num_layers=len(sizes), layer=max(sizes, key=lambda t: t.packed),
                      embedding=TensorBytes(packed=GB // 10), head=TensorBytes(packed=GB // 10),
                      kv_elements_per_token=per_token, layer_sizes=sizes, kv_layers=tuple(kv_layers))


def test_the_split_weighs_each_layer_at_its_own_size():
    # Three small dense layers before three expert layers: 1+1+1+3 = 3+3 GB per stage.
    model = layered([1, 1, 1, 3, 3, 3])
    stages, _ = plan_pipeline(model, seats(STUDIO, STUDIO), PlanRequest(8192))
    assert layers(stages) == [4, 2]
    for stage, (first, last) in zip(stages, [(True, False), (False, True)]):
        assert stage.weight_bytes == model.slice_weight_bytes(stage.layers.start, stage.layers.end, first=first,
                                                              last=last, element_bytes=2)


def test_a_model_fits_that_counting_every_layer_as_the_largest_would_refuse():
    # Six 1 GB layers and an 8 GB one on two 16 GB Macs (11.5 GB each with headroom): 6 GB and 8 GB fit;
    # seven layers of 8 GB would not.
    model = layered([1] * 6 + [8])
    stages, _ = plan_pipeline(model, seats(MINI, MINI), PlanRequest(4096))
    assert layers(stages) == [6, 1]
    assert all(s.headroom_bytes >= HEADROOM_FRACTION * s.budget_bytes for s in stages)
    with pytest.raises(PlanError, match="short by"):
        plan_pipeline(replace(model, layer_sizes=()), seats(MINI, MINI), PlanRequest(4096))
    # Layers that fit by count but not in order: the refusal says so.
    with pytest.raises(PlanError, match="no split into contiguous slices fits") as refused:
        plan_pipeline(layered([1] * 6 + [8, 8]), seats(MINI, MINI), PlanRequest(4096))
    assert "largest layer 8.00 GB" in str(refused.value)


def _stage_rule(model: ModelFacts, stage, max_num_seqs: int, max_model_len: int) -> int:
    budget = MemoryBudget(stage.budget_bytes * 5 // 4, stage.budget_bytes * 5 // 4, 0.8, 1, "GPU")
    return kv_token_capacity(budget, stage.weight_bytes, model.slice_kv(stage.layers.start, stage.layers.end), 2,
                             max_num_seqs, max_model_len, "s")


def test_sliding_window_layers_hold_at_most_their_window_per_sequence():
    # Every other layer slides over 128 positions: at 128k tokens they hold 128 per sequence, not 128k.
    kv = [LayerKV(2048, 128), LayerKV(2048)] * 8
    windowed = layered([0.5] * 16, kv, per_token=2048)
    full = replace(windowed, kv_layers=())
    request = PlanRequest(131072, max_num_seqs=16)
    stages, _ = plan_pipeline(windowed, seats(MINI, MINI), request)
    counted_full, _ = plan_pipeline(full, seats(MINI, MINI), request)
    for stage, other in zip(stages, counted_full):
        assert stage.kv_tokens == _stage_rule(windowed, stage, 16, 131072)  # what the stage will compute
        assert stage.kv_tokens > 1.9 * other.kv_tokens  # half the layers stop growing at their window
        kv_slice = windowed.slice_kv(stage.layers.start, stage.layers.end)
        assert stage.kv_bytes == kv_slice.reserved_bytes(stage.kv_tokens, 2, 16)
        assert stage.kv_bytes_per_token == kv_slice.per_token * 2  # only the full layers grow per position
        assert stage.weight_bytes + stage.kv_bytes + RUNTIME_OVERHEAD_BYTES <= stage.budget_bytes


def test_linear_attention_state_is_a_fixed_size_per_sequence():
    # Three linear-attention layers (a 40 MB state per sequence each) to one attention layer, as Qwen3-Next.
    state = LayerKV(state=TensorBytes(packed=40_000_000))
    model = layered([1] * 8, [state, state, state, LayerKV(1024)] * 2)
    request = PlanRequest(32768, max_num_seqs=32)
    stages, _ = plan_pipeline(model, seats(STUDIO, STUDIO), request)
    for stage in stages:
        assert stage.kv_tokens == _stage_rule(model, stage, 32, 32768)
        room = stage.budget_bytes - stage.weight_bytes - RUNTIME_OVERHEAD_BYTES
        kv_slice = model.slice_kv(stage.layers.start, stage.layers.end)
        # Every sequence's states are set aside before positions: 32 x 3 x 40 MB.
        assert kv_slice.state.packed == 3 * 40_000_000
        assert stage.kv_tokens == (room - 32 * 3 * 40_000_000) // (1024 * 2)
    # A stage of linear-attention layers only holds every sequence at full length once their states fit.
    (only,), _ = plan_pipeline(layered([1] * 3, [state] * 3), seats(STUDIO), request)
    assert only.kv_tokens == 32 * 32768 and only.kv_bytes == 32 * 3 * 40_000_000
    # More sequences' states than a stage holds: refused with the numbers.
    with pytest.raises(PlanError, match="do not fit"):
        plan_pipeline(model, seats(MINI), PlanRequest(4096, max_num_seqs=256))


def test_the_entry_stage_counts_the_draft_model_before_its_kv():
    """A 1B-shaped draft on each replica's first stage: its weights and KV for the sequences that may speculate
    (at full length, with the columns its batch may span) leave that stage less KV, as the stage counts it;
    the other stages are as without a draft."""
    draft = DraftFacts(weights=TensorBytes(elements=1_235_814_400), kv_elements_per_token=LLAMA_1B.slice_kv(
        0, 16).per_token, sequences=8, proposals=4)
    request = PlanRequest(8192, memory_fraction=0.8)
    plain, _ = plan_pipeline(LLAMA_8B, seats(STUDIO, MINI), request)
    stages, _ = plan_pipeline(LLAMA_8B, seats(STUDIO, MINI), replace(request, draft=draft))
    reserved = draft.weight_bytes(2) + 8 * draft_kv_columns(8192, 4) * draft.kv_bytes_per_token(2)
    assert stages[0].draft_bytes == draft.reserved_bytes(2, 8192) == reserved
    assert stages[1].draft_bytes == 0 and stages[1].kv_tokens == plain[1].kv_tokens
    first = stages[0]
    budget = MemoryBudget(96 * GB, 96 * GB, 0.8, 1, "GPU")
    kv = LLAMA_8B.slice_kv(first.layers.start, first.layers.end)
    assert kv_token_capacity(budget, first.weight_bytes + reserved, kv, 2, 64, 8192, "s") == first.kv_tokens
    assert first.need_bytes == first.weight_bytes + reserved + kv.reserved_bytes(8192, 2, 64) + RUNTIME_OVERHEAD_BYTES
    assert first.to_json()["draft_bytes"] == reserved and "draft model" in format_plan(plan_mesh(
        LLAMA_8B, [seats(STUDIO, MINI)], replace(request, draft=draft)))

