"""Token sampling on the last stage, per sequence, reproducible by seed.

Temperature 0 is greedy (argmax, as mlx-lm's ``greedy_sampler``). Otherwise the
row's log-probabilities go through mlx-lm's own top-k, top-p and min-p filters and a
categorical draw at the given temperature, keyed by ``(seed, position)``, so a
seeded request gives the same tokens whatever else shares its batch and
whichever stage layout serves it.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from stagemesh_core.sampling import SamplingParams

_MASK64 = (1 << 64) - 1


def _row_key(seed: int, position: int) -> mx.array:
    # A splitmix-style mix keeps neighbouring positions' keys unrelated.
    value = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9) & _MASK64
    return mx.random.key(value)


def sample_rows(logits: mx.array, params: Sequence[SamplingParams], positions: Sequence[int],
                min_ps: Sequence[float] | None = None) -> mx.array:
    """``float32[k, vocab]`` logits -> ``int32[k]`` token ids (evaluated lazily by the caller).

    ``min_ps``: each row's min-p (0 disables; None: none has one)."""
    if logits.shape[0] == 0:
        return mx.zeros((0,), dtype=mx.int32)
    if all(p.greedy for p in params):
        return mx.argmax(logits, axis=-1).astype(mx.int32)
    tokens = []
    for row, (p, position) in enumerate(zip(params, positions)):
        row_logits = logits[row : row + 1]
        if p.greedy:
            tokens.append(mx.argmax(row_logits, axis=-1))
            continue
        logprobs = row_logits - mx.logsumexp(row_logits, axis=-1, keepdims=True)
        if 0 < p.top_k < logprobs.shape[-1]:
            logprobs = apply_top_k(logprobs, p.top_k)
        if 0.0 < p.top_p < 1.0:
            logprobs = apply_top_p(logprobs, p.top_p)
        if min_ps is not None and min_ps[row] > 0.0:
            logprobs = apply_min_p(logprobs, min_ps[row])
        seed = p.seed if p.seed is not None else 0
        key = _row_key(seed, position)
        tokens.append(mx.random.categorical(logprobs * (1.0 / p.temperature), key=key))
    return mx.concatenate(tokens).astype(mx.int32)
