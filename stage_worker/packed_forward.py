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
from mlx_lm.models.cache import BatchKVCache, KVCache


@dataclass(frozen=True)
class Segment:
    """One sequence's prompt chunk: its rows in the packed batch and its standalone caches."""

    caches: Sequence[KVCache]
    num_tokens: int
    row_start: int = 0


@dataclass(frozen=True)
class DecodeRows:
    """One token each for a group of sequences: their rows, and per-layer ``BatchKVCache``."""

    rows: Sequence[int]
    caches: Sequence[BatchKVCache]


def packed_layers(
    layers: Sequence[nn.Module], hidden: mx.array, segments: Sequence[Segment], decode: DecodeRows | None = None
) -> mx.array:
    """``[T, hidden]`` -> ``[T, hidden]`` through ``layers`` (lazy); segments and decode rows cover the rows."""
    order = ([*decode.rows] if decode else []) + [r for s in segments for r in range(s.row_start,
                                                                                     s.row_start + s.num_tokens)]
    restore = None if order == list(range(len(order))) else mx.array(_inverse(order))
    h = hidden
    for index, layer in enumerate(layers):
        h = h + _attention(layer.self_attn, layer.input_layernorm(h), segments, decode, index, restore)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return h


def _inverse(order: Sequence[int]) -> list[int]:
    inverse = [0] * len(order)
    for position, row in enumerate(order):
        inverse[row] = position
    return inverse


def _attention(attn: nn.Module, x: mx.array, segments: Sequence[Segment], decode: DecodeRows | None,
               layer_index: int, restore: mx.array | None) -> mx.array:
    rows = x.shape[0]
    queries = attn.q_proj(x).reshape(rows, attn.n_heads, -1)
    keys = attn.k_proj(x).reshape(rows, attn.n_kv_heads, -1)
    values = attn.v_proj(x).reshape(rows, attn.n_kv_heads, -1)
    if hasattr(attn, "q_norm"):  # qwen3 normalizes per head before RoPE
        queries, keys = attn.q_norm(queries), attn.k_norm(keys)
    outputs = []
    if decode is not None:
        outputs.append(_decode_attention(attn, queries, keys, values, decode, layer_index))
    for segment in segments:
        start, end = segment.row_start, segment.row_start + segment.num_tokens
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
    out = mx.concatenate(outputs) if len(outputs) > 1 else outputs[0]
    if restore is not None:
        out = out[restore]
    return attn.o_proj(out)


def _decode_attention(attn: nn.Module, queries: mx.array, keys: mx.array, values: mx.array,
                      decode: DecodeRows, layer_index: int) -> mx.array:
    """mlx-lm's own attention on ``[B, heads, 1, dim]`` against the group's ``BatchKVCache``:
    per-row RoPE offsets, one append and one masked attention for the whole group."""
    cache = decode.caches[layer_index]
    index = mx.array(decode.rows)
    q = queries[index][:, :, None, :]
    k = keys[index][:, :, None, :]
    v = values[index][:, :, None, :]
    mask = cache.make_mask(1)
    q = attn.rope(q, offset=cache.offset)
    k = attn.rope(k, offset=cache.offset)
    k, v = cache.update_and_fetch(k, v)
    out = scaled_dot_product_attention(q, k, v, cache=cache, scale=attn.scale, mask=mask)
    return out.reshape(out.shape[0], -1)
