"""Sampling on the last stage: greedy is argmax; seeded draws repeat whatever the batch."""

import mlx.core as mx

from stage_worker.sampling.sampler import sample_rows
from stagemesh_core.sampling import GREEDY, SamplingParams


def _logits(rows=3, vocab=50, seed=0):
    return mx.random.normal((rows, vocab), key=mx.random.key(seed))


def test_greedy_is_argmax():
    logits = _logits()
    tokens = sample_rows(logits, [GREEDY] * 3, [5, 6, 7])
    assert tokens.dtype == mx.int32
    assert tokens.tolist() == mx.argmax(logits, axis=-1).tolist()


def test_seeded_sampling_is_reproducible_and_independent_of_batch_neighbours():
    logits = _logits()
    hot = SamplingParams(temperature=1.5, seed=42)
    alone = sample_rows(logits[1:2], [hot], [10]).tolist()
    batched = sample_rows(logits, [GREEDY, hot, SamplingParams(temperature=1.0, seed=7)], [3, 10, 4]).tolist()
    assert batched[1] == alone[0]
    draws = {tuple(sample_rows(logits[1:2], [hot], [p]).tolist()) for p in range(40)}
    assert len(draws) > 1  # the key changes with the position


def test_top_k_one_is_greedy():
    logits = _logits(rows=1, vocab=100, seed=3)
    tokens = [sample_rows(logits, [SamplingParams(temperature=2.0, top_k=1, seed=s)], [0]).item() for s in range(10)]
    assert set(tokens) == {mx.argmax(logits, axis=-1).item()}


def test_top_p_keeps_only_the_nucleus():
    logits = mx.array([[10.0, 9.0, -10.0, -10.0, -10.0]])
    tokens = {sample_rows(logits, [SamplingParams(temperature=1.0, top_p=0.5, seed=s)], [0]).item() for s in range(30)}
    assert tokens == {0}
