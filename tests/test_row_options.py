"""The last stage's per-row logits processors: batch-aware, equal to mlx-lm's own processors row by row."""

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import make_logits_processors

from stage_worker.batch import RowOptions
from stage_worker.sampling.row_options import RowProcessors, logprobs_from_body, rows_body, rows_from_body
from stage_worker.sampling.sampler import sample_rows
from stagemesh_core.sampling import GREEDY, SamplingParams

VOCAB = 64


def _options(stop_token_ids=(), prompt_len=0, prompt_token_ids=(), **sampling) -> RowOptions:
    return RowOptions(SamplingParams(**sampling), stop_token_ids, prompt_len, prompt_token_ids)


def _logits(rows: int, seed: int = 0) -> mx.array:
    return mx.random.normal((rows, VOCAB), key=mx.random.key(seed)) * 3


def _mlx_lm(row_options: RowOptions, prompt: list[int], generated: list[int], logits: mx.array) -> mx.array:
    """mlx-lm's processors on one row: repetition over prompt + output, presence/frequency over output."""
    big = 10_000  # mlx-lm looks at the last N tokens; ours at all of them
    row = logits
    options = row_options.sampling
    bias = dict(options.logit_bias) or None
    for proc in make_logits_processors(logit_bias=bias):
        row = proc(mx.array(prompt + generated), row)
    if options.repetition_penalty != 1.0:
        for proc in make_logits_processors(repetition_penalty=options.repetition_penalty,
                                           repetition_context_size=big):
            row = proc(mx.array(prompt + generated), row)
    for proc in make_logits_processors(presence_penalty=options.presence_penalty or None,
                                       presence_context_size=big,
                                       frequency_penalty=options.frequency_penalty or None,
                                       frequency_context_size=big):
        row = proc(mx.array(generated), row)
    return row


def test_a_batch_without_options_is_returned_untouched():
    rows = RowProcessors()
    logits = _logits(3)
    assert rows.process(logits, [1, 2, 3], [5, 5, 5]) is logits
    assert rows.logprobs(logits, mx.array([0, 1, 2]), [1, 2, 3]) is None
    assert rows.min_ps([1, 2, 3]) is None


def test_mixed_batch_matches_mlx_lm_processors_row_by_row():
    prompt = [3, 4, 5, 5]
    opts = {
        10: _options(presence_penalty=0.7, frequency_penalty=0.3, prompt_len=len(prompt)),
        11: _options(repetition_penalty=1.3, prompt_token_ids=tuple(prompt), prompt_len=len(prompt)),
        12: _options(logit_bias=((7, 5.0), (8, -3.0)), presence_penalty=-0.5, repetition_penalty=0.8,
                       prompt_token_ids=tuple(prompt), prompt_len=len(prompt)),
    }
    rows = RowProcessors()
    rows.register(opts)
    generated: dict[int, list[int]] = {s: [] for s in [10, 11, 12, 13]}  # 13: no options
    for step in range(6):
        seq_ids = [10, 13, 11, 12]
        logits = _logits(4, seed=step)
        expected = [
            _mlx_lm(opts[s], prompt, generated[s], logits[i:i + 1]) if s in opts else logits[i:i + 1]
            for i, s in enumerate(seq_ids)
        ]
        out = rows.process(mx.array(logits), seq_ids, [len(prompt) + step] * 4)
        np.testing.assert_allclose(np.array(out), np.array(mx.concatenate(expected)), rtol=1e-6, atol=1e-6)
        tokens = mx.array([step % 3 + 3, 9, step % 2 + 3, 7], mx.int32)  # repeats, so penalties accumulate
        rows.observe(seq_ids, tokens)
        mx.eval(*rows.pending())
        for s, t in zip(seq_ids, tokens.tolist()):
            generated[s].append(t)


def test_min_tokens_masks_stop_tokens_until_enough_were_generated():
    rows = RowProcessors()
    rows.register({1: _options(min_tokens=2, stop_token_ids=(0,), prompt_len=5)})
    logits = mx.zeros((1, VOCAB)).at[:, 0].add(100.0)  # the stop token would win
    assert sample_rows(rows.process(mx.array(logits), [1], [5]), [GREEDY], [5]).item() != 0
    assert sample_rows(rows.process(mx.array(logits), [1], [6]), [GREEDY], [6]).item() != 0
    assert sample_rows(rows.process(mx.array(logits), [1], [7]), [GREEDY], [7]).item() == 0


def test_allowed_token_ids_and_bias_restrict_the_draw():
    rows = RowProcessors()
    rows.register({1: _options(allowed_token_ids=(5, 6)), 2: _options(logit_bias=((9, 100.0),))})
    draws = set()
    for seed in range(30):
        out = rows.process(_logits(2, seed), [1, 2], [0, 0])
        tokens = sample_rows(out, [SamplingParams(temperature=1.0, seed=seed)] * 2, [0, 0]).tolist()
        draws.add(tokens[0])
        assert tokens[1] == 9
    assert draws <= {5, 6} and len(draws) == 2


def test_min_p_only_keeps_tokens_near_the_best():
    rows = RowProcessors()
    rows.register({1: _options(min_p=0.5)})
    logits = mx.array([[5.0, 4.9, 0.0, 0.0] + [-5.0] * (VOCAB - 4)])
    draws = {sample_rows(logits, [SamplingParams(temperature=2.0, seed=s)], [0], rows.min_ps([1])).item()
             for s in range(40)}
    assert draws == {0, 1}


def test_logprobs_are_the_log_softmax_of_the_processed_logits_top_sorted():
    rows = RowProcessors()
    rows.register({1: _options(logprobs=5), 3: _options(logprobs=0, logit_bias=((2, 4.0),))})
    logits = _logits(3, seed=7)
    processed = rows.process(mx.array(logits), [1, 2, 3], [0, 0, 0])
    tokens = mx.argmax(processed, axis=-1).astype(mx.int32)
    got = rows.logprobs(processed, tokens, [1, 2, 3])
    assert got is not None and got.rows == (0, 2)
    mx.eval(*got.arrays())
    read = got.read()
    reference = np.array(processed - mx.logsumexp(processed, axis=-1, keepdims=True))
    for row in (0, 2):
        assert math.isclose(read[row].logprob, reference[row, tokens.tolist()[row]], abs_tol=1e-5)
    top = read[0].top
    assert len(top) == 5 and [v for _, v in top] == sorted((v for _, v in top), reverse=True)
    assert top[0][0] == tokens.tolist()[0]
    np.testing.assert_allclose([v for _, v in top], np.sort(reference[0])[::-1][:5], atol=1e-5)
    assert read[2].top == ()


def test_options_travel_as_json_bodies():
    o = _options(presence_penalty=0.5, logit_bias=((3, 1.5),), logprobs=3, prompt_token_ids=(1, 2))
    assert rows_from_body(rows_body({42: o})) == {42: o}
    assert rows_body({}) is None and rows_from_body(None) == {}
    rows = RowProcessors()
    rows.register({1: _options(logprobs=2)})
    logits = _logits(1)
    lp = rows.logprobs(logits, mx.array([4], mx.int32), [1])
    assert lp is not None
    mx.eval(*lp.arrays())
    (back,) = logprobs_from_body(lp.to_body([1], [0]))[1]
    assert back.logprob == pytest.approx(lp.read()[0].logprob)
    assert [t for t, _ in back.top] == [t for t, _ in lp.read()[0].top]


def test_a_sequence_the_processors_leave_alone_sends_no_options():
    prompt = (3, 4, 5)
    assert RowOptions.for_sequence(SamplingParams(temperature=0.7, top_p=0.9, seed=3), prompt, {2}, False) is None
    assert RowOptions.for_sequence(SamplingParams(min_tokens=4), prompt, {2}, True) is None  # no stop to mask
    masked = RowOptions.for_sequence(SamplingParams(min_tokens=4), prompt, {2, 0}, False)
    assert masked is not None and masked.stop_token_ids == (0, 2) and masked.prompt_len == 3
    assert masked.prompt_token_ids == ()  # the prompt's tokens travel only for a repetition penalty
    repeated = RowOptions.for_sequence(SamplingParams(repetition_penalty=1.2), prompt, {2}, False)
    assert repeated is not None and repeated.prompt_token_ids == prompt and repeated.stop_token_ids == ()
    logprobs = RowOptions.for_sequence(SamplingParams(logprobs=0), prompt, (), False)
    assert logprobs is not None and not logprobs.transforms_logits
