"""Every served architecture through real pipelines equals mlx-lm's own greedy generation on the same files.

For each architecture, a tiny random-weight checkpoint in mlx-community's layout (``tests/architectures.py``):
mlx-lm's ``generate_step`` gives the reference tokens of each prompt alone; stagemesh then serves the same
files at PP=1, 2 and 3 (real engine, scheduler and relay loops, stages on threads joined by real lanes) and
must give those tokens for a prompt alone and for prompts of other lengths batched together, arriving at
different steps and finishing at different steps (so decode groups grow and shrink), with the prefix cache
on as serving sets it (on for models whose every layer keeps plain KV, off for windows and recurrent state),
a shared-prefix prompt included. Long prompts prefilled in small chunks at once (later chunks continuing
their sequences' caches) run as batches of chunks, at PP=1 and 2.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from stage_worker.cache.prefix_cache import PrefixCache
from stage_worker.checkpoint.mlx_arch import describe, exact_prefix_reuse
from stage_worker.checkpoint.model_reader import read_model_spec
from stage_worker.model.layer_stack import batch_groups, held_positions
from stage_worker.model.packed_forward import Segment
from stage_worker.model.stage_model import StackStageModel, StageModel, StageRole, runs_packed
from stagemesh_core.layer_split import LayerRange, even_split
from tests.architectures import TINY_CONFIGS, mlx_lm_greedy, tiny_checkpoint
from tests.engine_helpers import InProcessPipeline, read_until_finished

# Longer than the sliding windows (8) of the tiny gpt_oss and gemma3_text, so windows rotate.
PROMPTS = (
    (504, 3575, 282, 4649, 314, 1018, 28, 2270, 253, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21),
    (1, 2, 3),
    (17, 42, 99, 1000, 5, 6, 7, 8, 9, 10, 11),
)
MAX_TOKENS = (12, 7, 10)
# Shares PROMPTS[0]'s first 16 tokens (two prefix-cache blocks of 8).
SHARED_PREFIX = PROMPTS[0][:16] + (7, 7, 7)
BLOCK = 8
# Fresh prompts of nearly one length (longer than the windows), arriving together: prefilled as one left-padded
# batch (layer_stack.batch_groups) on the stack path.
TOGETHER = (tuple(range(300, 320)), tuple(range(400, 419)), tuple(range(500, 520)))
# Long prompts arriving together, prefilled CHUNK positions a sequence and at most BUDGET a batch: the third
# gets what the budget leaves (5 of 17), so the sequences' later chunks differ in length and in the positions
# their caches hold, and run as batches of chunks on the stack path. Longer than the windows, several times.
LONG = (tuple(range(600, 644)), tuple(range(700, 741)), tuple(range(800, 840)))
CHUNK, BUDGET = 6, 17


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    return tmp_path_factory.mktemp("architectures")


def _mlx_lm_greedy(path: str, prompts, max_tokens: int) -> list[list[int]]:
    from mlx_lm.utils import load

    model, _ = load(path)
    return mlx_lm_greedy(model, prompts, max_tokens)


def _stages(spec, depth: int) -> list[StageModel]:
    ranges = even_split(spec.num_layers, depth)
    return [StageModel.load(spec, StageRole(LayerRange(r.start, r.end), i == 0, i == depth - 1), mx.float32)
            for i, r in enumerate(ranges)]


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_pipelines_equal_mlx_lm_generation(checkpoints, name, monkeypatch):
    import stage_worker.model.layer_stack as layer_stack

    continued: list[list[int]] = []  # the positions held by each batch of chunks that continued sequences

    def recording_batch_groups(chunks, *args):
        groups = batch_groups(chunks, *args)
        continued.extend(held for held in ([layer_stack.held_positions(s) for s in g] for g in groups) if any(held))
        return groups

    monkeypatch.setattr(layer_stack, "batch_groups", recording_batch_groups)
    path = tiny_checkpoint(name, checkpoints)
    spec = read_model_spec(path)
    reference = _mlx_lm_greedy(path, PROMPTS + (SHARED_PREFIX,) + TOGETHER + LONG, max(MAX_TOKENS))
    expected = [ref[:n] for ref, n in zip(reference, MAX_TOKENS)]
    exact = exact_prefix_reuse(spec)
    for depth in (1, 2, 3):
        stages = _stages(spec, depth)
        assert isinstance(stages[0], StageModel if runs_packed(spec) else StackStageModel)
        prefix_cache = PrefixCache(BLOCK, b"test") if exact else None
        with InProcessPipeline(stages, prefix_cache=prefix_cache) as pipeline:
            alone = pipeline.generate(PROMPTS[2], MAX_TOKENS[2])
            assert alone == expected[2], f"PP={depth}: a prompt alone"
            # Two prompts together; the third arrives once the first has its first tokens (the decode group
            # grows), and they finish at different steps (it shrinks).
            first = [pipeline.submit(PROMPTS[0], MAX_TOKENS[0]), pipeline.submit(PROMPTS[1], MAX_TOKENS[1])]
            early = first[0].events.get(timeout=120)
            late = pipeline.submit(PROMPTS[2], MAX_TOKENS[2])
            outputs, _ = read_until_finished(first + [late])
            outputs[0] = list(early.token_ids) + outputs[0]
            assert outputs == expected, f"PP={depth}: prompts batched"
            # A prompt sharing the first one's prefix: reused from the prefix cache where it is exact.
            assert pipeline.generate(SHARED_PREFIX, MAX_TOKENS[0]) == reference[3][:MAX_TOKENS[0]], \
                f"PP={depth}: a prompt sharing a cached prefix"
            if exact:
                assert pipeline.scheduler.prefix_cache is not None
                assert pipeline.scheduler.prefix_cache.stats.hits >= 2 * BLOCK
            together, _ = read_until_finished([pipeline.submit(p, MAX_TOKENS[0]) for p in TOGETHER])
            assert together == [ref[:MAX_TOKENS[0]] for ref in reference[4:7]], f"PP={depth}: prefilled together"
        if depth == 3:
            continue
        with InProcessPipeline(_stages(spec, depth), max_batch_tokens=BUDGET, prefill_chunk_tokens=CHUNK) as pipeline:
            chunked, _ = read_until_finished([pipeline.submit(p, MAX_TOKENS[1]) for p in LONG])
            assert chunked == [ref[:MAX_TOKENS[1]] for ref in reference[7:]], f"PP={depth}: chunks batched"
        # The stack path ran later chunks together, on caches holding different numbers of positions.
        assert runs_packed(spec) or any(len(set(held)) > 1 for held in continued), continued


def test_fresh_prompts_of_nearly_one_length_are_prefilled_together():
    def groups(*lengths: int) -> list[list[int]]:
        return [[s.num_tokens for s in g] for g in batch_groups([Segment([], n) for n in lengths])]

    assert groups(*(len(p) for p in TOGETHER)) == [[20, 20, 19]]
    assert groups(32, 32, 32) == [[32, 32, 32]]
    # Padding at most a tenth of the real positions: 20 and 3 run alone, 60 and 58 together.
    assert groups(20, 3) == [] and groups(5, 60, 17, 58) == [[60, 58]]
    assert groups(7) == []


def test_later_chunks_group_by_length_and_by_the_positions_their_caches_hold():
    class Holding:
        def __init__(self, positions: int) -> None:
            self.positions = positions

        def size(self) -> int:
            return self.positions

    def groups(*chunks: tuple[int, int]) -> list[list[tuple[int, int]]]:
        segments = [Segment([Holding(held)], n) for n, held in chunks]
        return [[(s.num_tokens, held_positions(s)) for s in g] for g in batch_groups(segments)]

    # Padding of lengths 1 of 17, of histories 2 of 34: within a tenth each.
    assert groups((6, 12), (5, 10), (6, 12)) == [[(6, 12), (6, 12), (5, 10)]]
    # A first chunk (no history) never pads a sequence's history, nor a history's chunk is padded to twice.
    assert groups((6, 0), (6, 12)) == [] and groups((6, 12), (3, 12)) == []
    assert groups((6, 100), (6, 80)) == [] and groups((6, 100), (6, 95)) == [[(6, 100), (6, 95)]]
    # Two kinds of sequence at once: each its own batch.
    assert groups((8, 0), (8, 40), (8, 0), (8, 40)) == [[(8, 40), (8, 40)], [(8, 0), (8, 0)]]


def test_cache_kinds_follow_the_architecture():
    kinds = {name: set(describe(name, config).cache_kinds) for name, config in TINY_CONFIGS.items()}
    assert kinds["gpt_oss"] == {"kv", "rotating"} and kinds["gemma3_text"] == {"kv", "rotating"}
    assert kinds["qwen3_next"] == {"kv", "arrays"}
    assert all(kinds[name] == {"kv"} for name in ("deepseek_v3", "qwen3_moe", "mixtral", "llama", "olmoe"))
    assert describe("deepseek_v3", TINY_CONFIGS["deepseek_v3"]).array_masks


@pytest.mark.parametrize("command", ["plan", "serve"])
def test_a_model_that_cannot_be_split_is_refused_before_any_stage_loads(tmp_path, command, capsys):
    # The CLI's entry point in this process; unmarked, so tests/fast_tier.py fails the test if the command starts
    # a process or Ray before refusing.
    import json

    from stagemesh.cli import main

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma4_text", "hidden_size": 64,
                                                      "num_hidden_layers": 4}))
    code = main([command, str(tmp_path), "--load-format", "dummy", "-pp", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert "'gemma4_text' model, which cannot be split across pipeline stages" in err
    assert "stagemesh serves llama, qwen2, qwen3" in err


def _held_bytes(caches) -> int:
    """What a stage's caches hold for one sequence: the positions a KV cache keeps (a rotating one at most its
    window), every array a linear-attention cache keeps."""
    total = 0
    for cache in caches:
        if hasattr(cache, "keys"):
            n = min(cache.offset, cache.keys.shape[2])
            total += cache.keys[..., :n, :].nbytes + cache.values[..., :n, :].nbytes
        else:
            total += sum(a.nbytes for a in cache.cache if a is not None)
    return total


def _run_sequence(model: StageModel, hidden_size: int, prompt: int, decoded: int) -> list:
    """A prompt of ``prompt`` positions then ``decoded`` single steps through a slice; its caches (built, not
    evaluated: what they hold is in their shapes; the CPU has no half-precision expert matmul)."""
    caches = model.new_caches()
    model.run_packed(mx.random.normal((prompt, hidden_size)).astype(model.dtype), [Segment(caches, prompt)])
    for _ in range(decoded):
        model.run_packed(mx.random.normal((1, hidden_size)).astype(model.dtype), [Segment(caches, 1)])
    return caches


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_planner_facts_equal_the_bytes_each_stage_loads_and_holds(checkpoints, name):
    from stage_worker.model.model_facts import model_facts

    spec = read_model_spec(tiny_checkpoint(name, checkpoints))
    facts = model_facts(spec)
    n = spec.num_layers
    for start, end, first, last in [(0, n, True, True), (0, 1, True, False), (1, n - 1, False, False),
                                    (n - 1, n, False, True)]:
        model = StageModel.load(spec, StageRole(LayerRange(start, end), first, last), mx.float32)
        assert facts.slice_weight_bytes(start, end, first=first, last=last, element_bytes=4) == model.weight_bytes
        # What the stage's KV capacity counts for one sequence: a prompt longer than the windows (8), then a
        # decoded token (a rotating cache drops what left its window on the next step).
        caches = _run_sequence(model, spec.hidden_size, 20, 1)
        assert facts.slice_kv(start, end).sequence_bytes(21, 4) == _held_bytes(caches)
    if name == "deepseek_v3":  # MLA: the latent (kv_lora_rank) and the rotary key, one "head", per token
        config = TINY_CONFIGS[name]
        assert facts.kv_elements_per_token == config["kv_lora_rank"] + config["qk_rope_head_dim"]
        assert facts.slice_kv(0, n).per_token == n * facts.kv_elements_per_token
    if name in ("gpt_oss", "gemma3_text"):  # windows of 8 beside full layers
        assert {kv.window for kv in facts.kv_layers} == {8, None}
    if name == "qwen3_next":  # linear-attention layers: a state per sequence, no positions
        linear = [kv for kv in facts.kv_layers if kv.per_token == 0]
        assert len(linear) == 2 and all(kv.state.packed and kv.state.elements for kv in linear)


@pytest.mark.parametrize("name", ["qwen3_next", "gemma3_text", "deepseek_v3"])
def test_kv_facts_equal_what_a_bfloat16_stage_holds(checkpoints, name):
    """In a half-precision stage, keys, values and convolution state take 2 bytes an element and the linear
    attention's recurrent state, kept in float32 whatever the compute dtype, 4."""
    from stage_worker.model.model_facts import model_facts

    spec = read_model_spec(tiny_checkpoint(name, checkpoints))
    model = StageModel.load(spec, StageRole(LayerRange(0, spec.num_layers), True, True), mx.bfloat16)
    caches = _run_sequence(model, spec.hidden_size, 11, 2)
    assert model_facts(spec).slice_kv(0, spec.num_layers).sequence_bytes(13, 2) == _held_bytes(caches)


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_quantized_dummy_experts_load_as_the_planner_counts(tmp_path, name):
    import json

    from stage_worker.model.model_facts import model_facts

    config = {**TINY_CONFIGS[name], "quantization": {"group_size": 32, "bits": 4}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = read_model_spec(str(tmp_path), "dummy")
    facts = model_facts(spec)
    n = spec.num_layers
    for start, end, first, last in [(0, 2, True, False), (2, n, False, True)]:
        model = StageModel.load(spec, StageRole(LayerRange(start, end), first, last), mx.float16)
        assert model.quantized
        assert facts.slice_weight_bytes(start, end, first=first, last=last, element_bytes=2) == model.weight_bytes


# Parameters of the shipped shapes as their authors publish them (billions).
PUBLISHED_SIZES = {"qwen3-30b-a3b": 30.5, "qwen3-235b-a22b": 235.1, "gpt-oss-20b": 20.9, "gpt-oss-120b": 116.8,
                   "mixtral-8x7b": 46.7, "gemma-3-27b": 27.0, "qwen3-next-80b-a3b": 79.7, "deepseek-v3": 671.0}


@pytest.mark.parametrize("shape", sorted(PUBLISHED_SIZES))
def test_shipped_shapes_have_their_published_sizes(shape):
    from stage_worker.model.model_facts import model_facts
    from stagemesh.bench.random_checkpoint import SHAPES_DIR

    facts = model_facts(read_model_spec(str(SHAPES_DIR / shape), "dummy"))
    layers = facts.layer_sizes or (facts.layer,) * facts.num_layers
    head = 0 if facts.tied_embeddings else facts.head.elements
    total = sum(t.elements for t in layers) + facts.embedding.elements + head
    assert total / 1e9 == pytest.approx(PUBLISHED_SIZES[shape], rel=0.01)
