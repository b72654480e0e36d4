"""A stage's slice of any mlx-lm model that is a stack of layers, run as mlx-lm runs it.

Contract: ``stack_layers(layers, hidden, segments, decode, array_masks)`` takes the
``[T, hidden]`` rows of a packed batch (the wire layout, as ``packed_forward``) and
returns this stage's output rows, computed by mlx-lm's own decoder layers called as
each model's ``__call__`` calls them: ``layer(h, mask, cache)`` on ``[B, L, hidden]``.

* each prompt chunk (``Segment``) runs as one sequence, ``[1, n, hidden]``, against
  its own per-layer caches: the caches the model's ``make_cache`` asks for (KV,
  rotating KV for sliding windows, arrays for linear attention / SSM state, MLA's
  latent KV), exactly as ``mlx_lm.generate_step`` runs it;
* except first chunks of nearly one length (``prefill_groups``: left padding at
  most ``MAX_PADDING`` of their positions): those run as one left-padded
  ``[B, L, hidden]`` batch against empty batch caches of the same kinds, as
  mlx-lm's ``BatchGenerator`` prefills, and each sequence's caches are then
  extracted back into its own (the KV store keeps a prefilling sequence alone);
* the decode group (``DecodeRows``) runs as one ``[B, 1, hidden]`` batch against the
  group's batch caches (``BatchKVCache``, ``BatchRotatingKVCache``, a batched
  ``ArraysCache``: left-padded, per-row offsets), as mlx-lm's ``BatchGenerator``
  decodes: every per-row part of a layer, the expert routing included, runs once for
  the whole group.

Which mask a layer gets is decided by its own cache, the way the models themselves
decide (each builds one mask per kind of cache, from a cache of that kind): a layer
with an ``ArraysCache`` gets ``create_ssm_mask`` from it, any other
``create_attention_mask`` (a rotating cache applies its window). ``array_masks``: the
model's attention needs the mask as an array, never the ``"causal"`` shortcut (MLA
adds the mask to its rotary scores; ``mlx_arch.needs_array_masks``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask, create_ssm_mask
from mlx_lm.models.cache import ArraysCache, BatchKVCache, BatchRotatingKVCache, KVCache, RotatingKVCache

from stage_worker.packed_forward import DecodeRows, Segment

# Left padding a batched prefill may add, as a share of its real positions (``prefill_groups``).
MAX_PADDING = 0.1


def stack_layers(layers: Sequence[nn.Module], hidden: mx.array, segments: Sequence[Segment],
                 decode: DecodeRows | None, array_masks: bool) -> mx.array:
    """``[T, hidden]`` -> ``[T, hidden]`` through ``layers`` (lazy); segments and decode rows cover the rows."""
    outputs: list[mx.array] = []
    order: list[int] = []
    if decode is not None:
        rows = mx.array(decode.rows)
        out = run_batch(layers, hidden[rows][:, None, :], decode.caches, array_masks)
        outputs.append(out[:, 0, :])
        order += decode.rows
    together: set[int] = set()
    for group in prefill_groups([s for s in segments if _batchable(s.caches)]):
        outputs.append(_prefill_together(layers, hidden, group, array_masks))
        order += [row for segment in group for row in segment.rows]
        together.update(id(segment) for segment in group)
    for segment in segments:
        if id(segment) in together:
            continue
        start, end = segment.row_start, segment.row_start + segment.num_tokens
        outputs.append(run_batch(layers, hidden[start:end][None], segment.caches, array_masks)[0])
        order += segment.rows
    out = mx.concatenate(outputs) if len(outputs) > 1 else outputs[0]
    if order != list(range(len(order))):
        out = out[mx.array(_inverse(order))]
    return out


def prefill_groups(fresh: Sequence[Segment], max_padding: float = MAX_PADDING) -> list[list[Segment]]:
    """First chunks of similar length, longest first, grouped so that each group's left padding adds at most
    ``max_padding`` of its real positions (padding costs as much as real work once compute dominates);
    groups of two or more only (a chunk alone runs as it is)."""
    groups: list[list[Segment]] = []
    for segment in sorted(fresh, key=lambda s: -s.num_tokens):
        group = groups[-1] if groups else None
        if group is not None and (len(group) + 1) * group[0].num_tokens <= (1 + max_padding) * (
                sum(s.num_tokens for s in group) + segment.num_tokens):
            group.append(segment)
        else:
            groups.append([segment])
    return [group for group in groups if len(group) > 1]


def _batchable(caches: Sequence[Any]) -> bool:
    """A sequence's first chunk (every cache empty) whose caches have a left-padded batch form."""
    return all(type(c) in (KVCache, ArraysCache) or (type(c) is RotatingKVCache and c.keep == 0)
               for c in caches) and all(c.empty() for c in caches)


def _prefill_together(layers: Sequence[nn.Module], hidden: mx.array, fresh: Sequence[Segment],
                      array_masks: bool) -> mx.array:
    """Several sequences' first chunks as one left-padded ``[B, L, hidden]`` batch against batch caches (as
    mlx-lm's ``BatchGenerator`` prefills), each sequence's caches then extracted back into its own; the
    chunks' output rows, in ``fresh`` order."""
    length = max(s.num_tokens for s in fresh)
    padding = [length - s.num_tokens for s in fresh]
    pad_row = hidden.shape[0]  # a zero row appended below: what the padded positions read
    index = [[pad_row] * pad + list(s.rows) for pad, s in zip(padding, fresh)]
    padded = mx.concatenate([hidden, mx.zeros((1, hidden.shape[1]), hidden.dtype)])[mx.array(index)]
    caches = [_batch_cache(c, padding) for c in fresh[0].caches]
    out = run_batch(layers, padded, caches, array_masks)
    for layer, cache in enumerate(caches):
        for b, segment in enumerate(fresh):
            vars(segment.caches[layer]).update(vars(cache.extract(b)))
    return out.reshape(-1, out.shape[-1])[mx.array([b * length + j for b, pad in enumerate(padding)
                                                    for j in range(pad, length)])]


def _batch_cache(cache: Any, padding: list[int]) -> Any:
    """An empty batch cache of ``cache``'s kind, its rows left-padded by ``padding``."""
    if isinstance(cache, ArraysCache):
        return ArraysCache(len(cache.cache), left_padding=padding)
    if isinstance(cache, RotatingKVCache):
        return BatchRotatingKVCache(cache.max_size, padding)
    return BatchKVCache(padding)


def run_batch(layers: Sequence[nn.Module], h: mx.array, caches: Sequence[Any], array_masks: bool) -> mx.array:
    """``[B, L, hidden]`` through ``layers`` with one cache each (single or batched), lazy."""
    masks: dict[tuple[type, int | None], Any] = {}
    for layer, cache in zip(layers, caches):
        kind = (type(cache), getattr(cache, "max_size", None))
        if kind not in masks:
            masks[kind] = layer_mask(h, cache, array_masks)
        h = layer(h, masks[kind], cache)
    return h


def layer_mask(h: mx.array, cache: Any, array_masks: bool) -> Any:
    """The mask mlx-lm's models build for a layer holding ``cache``, for input ``h`` of ``[B, L, hidden]``."""
    if isinstance(cache, ArraysCache):
        return create_ssm_mask(h, cache)
    return create_attention_mask(h, cache, return_array=array_masks)


def _inverse(order: Sequence[int]) -> list[int]:
    inverse = [0] * len(order)
    for position, row in enumerate(order):
        inverse[row] = position
    return inverse
