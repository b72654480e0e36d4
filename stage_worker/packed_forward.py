"""Packed forward: many sequences' rows through a stage's decoder layers in one pass.

A batch arrives as ``[T, hidden]`` rows, sequence after sequence (the wire
layout). Everything that is per-row — norms, the q/k/v and output projections,
the MLP — runs once over all ``T`` rows, so a batch of 16 decodes costs one
``[16, hidden]`` GEMM per projection instead of 16 GEMVs. Only attention is
per sequence: each sequence applies RoPE at its own offset, appends to its own
mlx-lm ``KVCache`` and attends over its own history, with no padding.

The modules are mlx-lm's own (``TransformerBlock`` of llama / qwen2 / qwen3,
with ``self_attn.{q,k,v,o}_proj``, optional ``q_norm`` / ``k_norm``, ``rope``,
``mlp`` and the two RMS norms); this file only reorders their calls. Results
depend on the batch's composition only through GEMM blocking, which is why
parity compares runs with identical batches and batched-vs-unbatched checks
compare greedy tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention
from mlx_lm.models.cache import KVCache


@dataclass(frozen=True)
class Segment:
    """One sequence's rows in a packed batch and the caches of this stage's layers."""

    caches: Sequence[KVCache]
    num_tokens: int


def packed_layers(layers: Sequence[nn.Module], hidden: mx.array, segments: Sequence[Segment]) -> mx.array:
    """``[T, hidden]`` -> ``[T, hidden]`` through ``layers`` (lazy); ``segments`` cover the rows in order."""
    h = hidden
    for index, layer in enumerate(layers):
        h = h + _attention(layer.self_attn, layer.input_layernorm(h), segments, index)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return h


def _attention(attn: nn.Module, x: mx.array, segments: Sequence[Segment], layer_index: int) -> mx.array:
    rows = x.shape[0]
    queries = attn.q_proj(x).reshape(rows, attn.n_heads, -1)
    keys = attn.k_proj(x).reshape(rows, attn.n_kv_heads, -1)
    values = attn.v_proj(x).reshape(rows, attn.n_kv_heads, -1)
    if hasattr(attn, "q_norm"):  # qwen3 normalizes per head before RoPE
        queries, keys = attn.q_norm(queries), attn.k_norm(keys)
    if all(s.num_tokens == 1 for s in segments) and len(segments) > 1:
        out = _decode_attention(attn, queries, keys, values, [s.caches[layer_index] for s in segments])
        return attn.o_proj(out)
    outputs = []
    start = 0
    for segment in segments:
        end = start + segment.num_tokens
        cache = segment.caches[layer_index]
        # [n, heads, dim] -> [1, heads, n, dim], mlx-lm's attention layout
        q = queries[start:end].transpose(1, 0, 2)[None]
        k = keys[start:end].transpose(1, 0, 2)[None]
        v = values[start:end].transpose(1, 0, 2)[None]
        mask = create_attention_mask(x[start:end][None], cache)
        q = attn.rope(q, offset=cache.offset)
        k = attn.rope(k, offset=cache.offset)
        k, v = cache.update_and_fetch(k, v)
        out = scaled_dot_product_attention(q, k, v, cache=cache, scale=attn.scale, mask=mask)
        outputs.append(out[0].transpose(1, 0, 2).reshape(segment.num_tokens, -1))
        start = end
    return attn.o_proj(mx.concatenate(outputs) if len(outputs) > 1 else outputs[0])


def _decode_attention(
    attn: nn.Module, queries: mx.array, keys: mx.array, values: mx.array, caches: Sequence[KVCache]
) -> mx.array:
    """One new token per sequence: RoPE for all rows in one call (per-row offsets), each
    sequence's keys/values appended to its own cache, then one attention over the
    histories right-padded to the longest, with the padding masked out."""
    offsets = mx.array([c.offset for c in caches])
    q = attn.rope(queries[:, :, None, :], offset=offsets)  # [B, heads, 1, dim]
    k = attn.rope(keys[:, :, None, :], offset=offsets)
    v = values[:, :, None, :]
    histories = [c.update_and_fetch(k[i : i + 1], v[i : i + 1]) for i, c in enumerate(caches)]
    lengths = [h[0].shape[2] for h in histories]
    longest = max(lengths)

    def padded(index: int) -> mx.array:
        parts = [h[index] for h in histories]
        return mx.concatenate([
            p if p.shape[2] == longest else mx.pad(p, [(0, 0), (0, 0), (0, longest - p.shape[2]), (0, 0)])
            for p in parts
        ])

    mask = (mx.arange(longest)[None, :] < mx.array(lengths)[:, None])[:, None, None, :]
    out = mx.fast.scaled_dot_product_attention(q, padded(0), padded(1), scale=attn.scale, mask=mask)
    return out.reshape(out.shape[0], -1)
