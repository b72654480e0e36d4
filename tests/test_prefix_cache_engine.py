"""Prefix caching on the real default model, one stage in this process (engine, scheduler, KV store):
greedy output with the cache on equals the cache off for prompts sharing a prefix of any length, and a
small KV budget evicts cached prefixes instead of failing a request."""

from __future__ import annotations

import functools
import random
import threading

import pytest

from stage_worker.cache.prefix_cache import PrefixCache
from stage_worker.engine.entry_engine import EntryEngine
from stage_worker.engine.scheduler import GenerationRequest, Scheduler
from stage_worker.engine.stage_runtime import EntryPipeline, StageCompute
from stage_worker.engine.stage_status import StageStatus
from tests.engine_helpers import as_served

pytestmark = pytest.mark.e2e

BLOCK = 8
_rng = random.Random(12)
BASE = tuple(_rng.randrange(300, 20000) for _ in range(37))
OTHER = tuple(_rng.randrange(300, 20000) for _ in range(9))


def load_whole_model(path: str):
    """The default model's every layer as one stage, in the backend's default dtype."""
    from stage_worker.checkpoint.model_reader import read_model_spec
    from stage_worker.model.device import current_backend
    from stage_worker.model.stage_model import StageModel, StageRole, resolve_compute_dtype
    from stagemesh_core.layer_split import LayerRange

    spec = read_model_spec(path)
    dtype = resolve_compute_dtype("auto", current_backend())
    return as_served(StageModel.load(spec, StageRole(LayerRange(0, spec.num_layers), True, True), dtype))


@pytest.fixture(scope="module")
def model(default_model_path):
    return load_whole_model(default_model_path)


class _Engine:
    """A real entry engine on its own thread; ``generate`` waits for one request's tokens."""

    def __init__(self, model, prefix_cache: PrefixCache | None, kv_tokens: int | None = None) -> None:
        self.compute = StageCompute(model, 16)
        self.scheduler = Scheduler(max_num_seqs=16, max_model_len=256, max_waiting=64, max_batch_tokens=64,
                                   prefill_chunk_tokens=64, kv_token_capacity=kv_tokens, prefix_cache=prefix_cache)
        self.engine = EntryEngine(EntryPipeline(self.compute, None, None, is_last=True), self.scheduler,
                                  StageStatus())
        self._count = 0
        self._thread = threading.Thread(target=self.engine.run, daemon=True)
        self._thread.start()

    def submit(self, prompt, max_tokens=6):
        self._count += 1
        return self.engine.submit(GenerationRequest(f"r{self._count}", tuple(prompt), max_tokens, ignore_eos=True))

    @staticmethod
    def tokens(handle) -> list[int]:
        out: list[int] = []
        while True:
            event = handle.events.get(timeout=120)
            assert hasattr(event, "token_ids"), f"request failed: {event}"
            out += event.token_ids
            if event.finish is not None:
                return out

    def generate(self, prompt, max_tokens=6) -> list[int]:
        return self.tokens(self.submit(prompt, max_tokens))

    def stop(self) -> None:
        self.engine.stop()
        self._thread.join(60)


def _conversation(engine: _Engine) -> list[list[int]]:
    """Prompts sharing prefixes of every kind, one after another, then two at once."""
    outputs = [engine.generate(BASE)]  # cached: 37 + 5 fed = 42 positions -> 5 blocks of 8
    outputs.append(engine.generate(BASE[:29] + OTHER))  # diverges inside block 4: reuses 3 blocks
    outputs.append(engine.generate(BASE[:20]))  # entirely a prefix of a cached one, ends inside a block
    outputs.append(engine.generate(BASE[:16]))  # ends on a block boundary: the last block is prefilled
    outputs.append(engine.generate(BASE))  # the same prompt again
    outputs.append(engine.generate(BASE + tuple(outputs[0]) + OTHER))  # the next turn re-sends its history
    handles = [engine.submit(BASE[:33] + OTHER[:i]) for i in (2, 7)]
    outputs += [engine.tokens(h) for h in handles]
    return outputs


@functools.cache
def conversation_without_cache(path: str) -> list[list[int]]:
    """``_conversation`` on the whole model without a prefix cache: what this file and
    tests/e2e/test_prefix_cache_e2e.py compare against, computed once a session."""
    engine = _Engine(load_whole_model(path), None)
    try:
        return _conversation(engine)
    finally:
        engine.stop()


def test_greedy_output_with_the_prefix_cache_equals_the_cache_off(model, default_model_path):
    expected = conversation_without_cache(default_model_path)
    cache = PrefixCache(BLOCK)
    on = _Engine(model, cache)
    try:
        assert _conversation(on) == expected
    finally:
        on.stop()
    assert cache.stats.hits >= 32 + 24 + 16 + 8 + 32 + 40
    # Every copy happened in a batch before its sequence's first token came back.
    assert on.compute.kv.prefix_reused_tokens == cache.stats.hits


def test_a_small_kv_budget_evicts_cached_prefixes_and_fails_no_request(model):
    prompts = [BASE[: 12 + 5 * i] + OTHER[: i % 3] for i in range(5)] + \
        [tuple(_rng.randrange(300, 20000) for _ in range(30)) for _ in range(3)]
    off = _Engine(model, None)
    try:
        expected = [off.generate(p, 3) for p in prompts]
    finally:
        off.stop()
    cache = PrefixCache(BLOCK)
    on = _Engine(model, cache, kv_tokens=64)  # room for one request and a few cached blocks
    try:
        handles = [on.submit(p, 3) for p in prompts[:2]]  # two at once: the second waits for room
        outputs = [on.tokens(h) for h in handles] + [on.generate(p, 3) for p in prompts[2:]]
        assert on.scheduler.reserved_tokens + cache.cached_tokens <= 64
    finally:
        on.stop()
    assert outputs == expected
    assert cache.stats.evicted_blocks > 0 and cache.stats.hits > 0
    assert on.compute.kv.prefix_reused_tokens == cache.stats.hits
    # (the last retirement's records may still wait for a next batch that never comes: at most that many)
    assert 0 < on.compute.kv.prefix_evicted_tokens <= cache.stats.evicted_blocks * BLOCK
