"""Quantized KV (``--kv-cache-dtype q8|q4``) on tiny random checkpoints, in a real in-process pipeline at PP=1
and PP=2, against mlx-lm's own ``generate_step`` over mlx-lm's ``QuantizedKVCache`` on the same files.

Every plain KV layer stores its positions quantized from position 0 and attention reads them quantized
(``stage_worker.cache.quantized_kv``); sliding windows and recurrent state stay as they are. Greedy tokens
equal mlx-lm's, alone and batched (decode groups in ``BatchQuantizedKVCache``), and with the prefix cache on
(entries copied as codes) equal to it off. The planner and the stage count the bytes exactly; bad values are
refused naming what works.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

from stage_worker.cache.prefix_cache import PrefixCache
from stage_worker.cache.quantized_kv import SequenceQuantizedKVCache
from stage_worker.checkpoint.mlx_arch import check_kv_cache_dtype, exact_prefix_reuse
from stage_worker.checkpoint.model_reader import read_model_spec
from stage_worker.model.model_facts import model_facts
from stage_worker.model.stage_model import StageModel, StageRole
from stagemesh_core.errors import UserError
from stagemesh_core.kv_cache_dtype import parse_kv_cache_dtype
from stagemesh_core.layer_split import LayerRange, even_split
from tests.architectures import TINY_CONFIGS
from tests.engine_helpers import InProcessPipeline, read_until_finished

pytestmark = pytest.mark.e2e

GROUP = 32  # the tiny checkpoints' heads are 32 wide here (a group must divide them)
PROMPTS = ((1, 2, 3, 4, 5, 6, 7), tuple(range(100, 137)), (9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12))
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return tmp_path_factory.mktemp("quantized-kv")


def _checkpoint(name: str, root) -> str:
    from stagemesh.bench.random_checkpoint import write_random_checkpoint

    out = root / name
    if not (out / "model.safetensors").is_file():
        write_random_checkpoint({**TINY_CONFIGS[name], "head_dim": GROUP}, out, dtype="float32",
                                seed=sum(map(ord, name)))
    return str(out)


def _mlx_lm_quantized(path: str, bits: int) -> list[list[int]]:
    """mlx-lm's greedy tokens with every plain KV layer a ``QuantizedKVCache`` from the first position."""
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load

    model, _ = load(path)
    outputs = []
    for prompt in PROMPTS:
        cache = [QuantizedKVCache(GROUP, bits) if type(c) is KVCache else c for c in make_prompt_cache(model)]
        steps = generate_step(mx.array(prompt), model, max_tokens=MAX_TOKENS, prompt_cache=cache,
                              sampler=lambda logits: mx.argmax(logits, axis=-1))
        outputs.append([int(token) for token, _ in steps])
    return outputs


def _stages(spec, depth: int, kv_dtype) -> list[StageModel]:
    stages = [StageModel.load(spec, StageRole(LayerRange(r.start, r.end), i == 0, i == depth - 1), mx.float32)
              for i, r in enumerate(even_split(spec.num_layers, depth))]
    for stage in stages:
        stage.kv_cache_dtype = kv_dtype
    return stages


def _alone_and_batched(pipeline: InProcessPipeline) -> tuple[list[list[int]], list[list[int]]]:
    alone = [pipeline.generate(prompt, MAX_TOKENS) for prompt in PROMPTS]
    batched, _ = read_until_finished([pipeline.submit(prompt, MAX_TOKENS) for prompt in PROMPTS])
    return alone, batched


@pytest.mark.parametrize(("name", "bits"), [("llama", 8), ("llama", 4), ("qwen3_next", 8), ("gemma3_text", 8),
                                            ("qwen3_moe", 4)])
def test_greedy_tokens_equal_mlx_lms_over_its_quantized_cache(checkpoints, name, bits):
    path = _checkpoint(name, checkpoints)
    spec = read_model_spec(path)
    kv_dtype = parse_kv_cache_dtype(f"q{bits}", GROUP)
    check_kv_cache_dtype(spec, kv_dtype)
    expected = _mlx_lm_quantized(path, bits)
    for depth in (1, 2):
        stages = _stages(spec, depth, kv_dtype)
        kinds = {type(c) for stage in stages for c in stage.new_caches()}
        assert SequenceQuantizedKVCache in kinds and KVCache not in kinds, kinds
        with InProcessPipeline(stages) as pipeline:
            alone, batched = _alone_and_batched(pipeline)
        assert alone == expected, f"{name} q{bits} PP={depth} alone"
        assert batched == expected, f"{name} q{bits} PP={depth} batched"


def test_prefix_entries_of_quantized_kv_equal_the_cache_off(checkpoints):
    spec = read_model_spec(_checkpoint("llama", checkpoints))
    assert exact_prefix_reuse(spec)
    kv_dtype = parse_kv_cache_dtype("q8", GROUP)
    system = tuple(range(200, 240))

    def conversation(pipeline: InProcessPipeline) -> list[list[int]]:
        history, out = system + (1, 2), []
        for turn in range(3):
            reply = pipeline.generate(history, 6)
            out.append(reply)
            history = history + tuple(reply) + (50 + turn, 51)
        handles = [pipeline.submit(system + (7, 7, 7), 5), pipeline.submit(system[:24] + (3,), 5)]
        out += read_until_finished(handles)[0]
        return out

    for depth in (1, 2):
        with InProcessPipeline(_stages(spec, depth, kv_dtype)) as off:
            expected = conversation(off)
        cache = PrefixCache(8, b"test")
        with InProcessPipeline(_stages(spec, depth, kv_dtype), prefix_cache=cache) as on:
            assert conversation(on) == expected, f"PP={depth}"
        assert cache.stats.hits >= 2 * len(system), cache.stats


def test_the_planner_counts_quantized_positions_exactly(checkpoints):
    spec = read_model_spec(_checkpoint("gemma3_text", checkpoints))
    facts = model_facts(spec)
    auto, q8, q4 = (facts.with_kv_cache_dtype(parse_kv_cache_dtype(n, GROUP)).slice_kv(0, spec.num_layers)
                    for n in ("auto", "q8", "q4"))
    # Full-attention layers: 2 (keys, values) x 2 KV heads x 32 per position; the 8-position windows unchanged.
    full_layers = sum(1 for t in facts.kv_layers if t.window is None)
    elements = full_layers * 2 * 2 * GROUP
    assert auto.per_token_bytes(4) == elements * 4
    assert q8.per_token_bytes(4) == elements + 2 * (elements // GROUP) * 4
    assert q4.per_token_bytes(2) == elements // 2 + 2 * (elements // GROUP) * 2
    assert q8.windows == auto.windows and q8.state == auto.state


@pytest.mark.parametrize(("name", "value", "says"), [
    ("gpt_oss", "q8", "attention adds sinks"),
    ("llama", "fp8", "use q8"),
    ("llama", "q3", "not one of auto, q8, q4"),
])
def test_values_the_model_cannot_take_are_refused_naming_what_works(checkpoints, name, value, says):
    spec = read_model_spec(_checkpoint(name, checkpoints))
    with pytest.raises(UserError, match=says):
        check_kv_cache_dtype(spec, parse_kv_cache_dtype(value, GROUP))


def test_a_group_that_does_not_divide_the_heads_names_one_that_does(checkpoints):
    spec = read_model_spec(_checkpoint("llama", checkpoints))
    with pytest.raises(UserError, match="use --kv-cache-group-size 32"):
        check_kv_cache_dtype(spec, parse_kv_cache_dtype("q8", 64))
