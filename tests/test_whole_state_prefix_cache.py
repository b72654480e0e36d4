"""Prefix reuse for models whose layers cannot be cut at a position (a sliding window: gpt_oss, gemma3_text; a
recurrent state: qwen3_next), on tiny random checkpoints, in a real in-process pipeline at PP=1 and PP=2.

Such a model's prefix entry is a finished sequence's whole state (``PrefixCache(exact=True)``,
``KVStore._retain_whole``): a later turn that re-sends the conversation restores all of it and prefills only
what it adds. Each prompt's state before its last token is kept too (a prompt checkpoint), so a regenerated turn
restores all but one token. Greedy output equals the cache off, token for token, alone and batched; a prompt that
diverges inside an entry restores nothing (a state cannot be cut) and still equals the cache off.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from stage_worker.cache.prefix_cache import PrefixCache
from stage_worker.checkpoint.mlx_arch import exact_prefix_reuse, whole_state_reuse
from stage_worker.checkpoint.model_reader import read_model_spec
from stage_worker.model.stage_model import StageModel, StageRole
from stagemesh_core.layer_split import LayerRange, even_split
from tests.architectures import tiny_checkpoint
from tests.engine_helpers import InProcessPipeline, read_until_finished

pytestmark = pytest.mark.e2e

BLOCK = 8
SYSTEM = tuple(range(1000, 1030))  # longer than the tiny models' windows (8): they rotate
NAMES = ("gemma3_text", "gpt_oss", "qwen3_next")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return tmp_path_factory.mktemp("whole-state")


def _stages(spec, depth: int) -> list[StageModel]:
    return [StageModel.load(spec, StageRole(LayerRange(r.start, r.end), i == 0, i == depth - 1), mx.float32)
            for i, r in enumerate(even_split(spec.num_layers, depth))]


def _conversation(pipeline: InProcessPipeline) -> list[list[int]]:
    """Two conversations of three turns, each turn re-sending the history and its reply; the second
    conversation's turns run batched beside a fresh prompt; then a prompt diverging inside the first turn."""
    out = []
    history = SYSTEM + (5, 6, 7)
    for turn in range(3):
        reply = pipeline.generate(history, 6)
        out.append(reply)
        history = history + tuple(reply) + (40 + turn, 41, 42, 43, 44)
    other = SYSTEM[:10] + (9, 9, 9)
    for turn in range(3):
        handles = [pipeline.submit(other, 5), pipeline.submit(tuple(range(2000, 2012 + turn)), 5)]
        replies, _ = read_until_finished(handles)
        out += replies
        other = other + tuple(replies[0]) + (60 + turn, 61, 62)
    out.append(pipeline.generate(SYSTEM[:20] + (1, 2, 3), 5))
    return out


def _cache_on_equals_off(spec, depth: int, drive) -> PrefixCache:
    """``drive`` over a PP=``depth`` pipeline with the prefix cache off, then on: the same tokens; the cache."""
    with InProcessPipeline(_stages(spec, depth)) as off:
        expected = drive(off)
    cache = PrefixCache(BLOCK, b"test", exact=True)
    with InProcessPipeline(_stages(spec, depth), prefix_cache=cache) as on:
        assert drive(on) == expected, f"{spec.model_type} PP={depth}"
    return cache


@pytest.mark.parametrize("name", NAMES)
def test_a_conversation_restores_its_whole_history_and_equals_the_cache_off(checkpoints, name):
    spec = read_model_spec(tiny_checkpoint(name, checkpoints))
    assert not exact_prefix_reuse(spec) and whole_state_reuse(spec)
    for depth in (1, 2):
        cache = _cache_on_equals_off(spec, depth, _conversation)
        # Turns 2 and 3 of each conversation restored the whole previous turn: its prompt and the reply's
        # tokens fed (the last sampled one was never fed).
        first = len(SYSTEM) + 3
        second = first + 6 + 5
        least = (first + 5) + (second + 5) + (13 + 4) + (13 + 4 + 3 + 4)
        assert cache.stats.hits >= least, (name, depth, cache.stats)


def _regenerations(pipeline: InProcessPipeline) -> list[list[int]]:
    """A turn generated, regenerated, then re-sent with something else appended instead of its reply; then two
    regenerations of another prompt batched beside a fresh one."""
    prompt = SYSTEM + (5, 6, 7)
    out = [pipeline.generate(prompt, 6), pipeline.generate(prompt, 6), pipeline.generate(prompt + (70, 71), 5)]
    other = SYSTEM[:12] + (8, 8, 8)
    out.append(pipeline.generate(other, 4))
    handles = [pipeline.submit(other, 4), pipeline.submit(other, 4), pipeline.submit(tuple(range(2000, 2020)), 4)]
    replies, _ = read_until_finished(handles)
    return out + replies


@pytest.mark.parametrize("name", NAMES)
def test_a_regenerated_turn_restores_its_prompt_checkpoint_and_equals_the_cache_off(checkpoints, name):
    spec = read_model_spec(tiny_checkpoint(name, checkpoints))
    for depth in (1, 2):
        cache = _cache_on_equals_off(spec, depth, _regenerations)
        # The regeneration and the appended prompt restore the first prompt's checkpoint (all but its last
        # token); the batched regenerations restore the other prompt's. The finished states cannot serve them.
        first, other = len(SYSTEM) + 3, 15
        assert cache.stats.hits >= 2 * (first - 1) + 2 * (other - 1), (name, depth, cache.stats)


def test_exact_entries_are_found_only_whole_and_supersede_their_beginnings():
    cache = PrefixCache(4, exact=True)
    kept = cache.insert(tuple(range(10)), 10)
    assert kept.entry_id and kept.tokens == 10  # every position, not whole blocks
    assert cache.lookup(tuple(range(9)) + (99, 100)) is None  # diverges inside it: nothing restorable
    assert cache.lookup(tuple(range(10))) is None  # nothing left to prefill
    hit = cache.lookup(tuple(range(12)))
    assert hit is not None and (hit.entry_id, hit.tokens) == (kept.entry_id, 10)
    cache.release(hit.entry_id)
    longer = cache.insert(tuple(range(15)), 15)
    assert longer.superseded == (kept.entry_id,) and cache.cached_tokens == 15
    assert cache.lookup(tuple(range(12))) is None  # the shorter state is gone; the longer one cannot be cut
    hit = cache.lookup(tuple(range(20)))
    assert hit is not None and hit.tokens == 15


def test_a_prompt_checkpoint_is_not_superseded_by_its_own_finished_state():
    cache = PrefixCache(4, exact=True)
    checkpoint = cache.insert_checkpoint(tuple(range(9)))
    finished = cache.insert(tuple(range(12)), 12)
    assert finished.superseded == () and cache.cached_tokens == 21
    hit = cache.lookup(tuple(range(10)))  # the same prompt again: all but its last token
    assert hit is not None and (hit.entry_id, hit.tokens) == (checkpoint.entry_id, 9)
    cache.release(hit.entry_id)
    later = cache.insert_checkpoint(tuple(range(15)))  # a later turn's prompt holds both whole
    assert set(later.superseded) == {checkpoint.entry_id, finished.entry_id} and cache.cached_tokens == 15
    with pytest.raises(ValueError, match="exact-mode"):
        PrefixCache(4).insert_checkpoint(tuple(range(9)))
