"""A stage's slice of any mlx-lm model that is a stack of layers, run as mlx-lm runs it.

Contract: ``stack_layers(layers, hidden, segments, decode, array_masks)`` takes the
``[T, hidden]`` rows of a packed batch (the wire layout, as ``packed_forward``) and
returns this stage's output rows, computed by mlx-lm's own decoder layers called as
each model's ``__call__`` calls them: ``layer(h, mask, cache)`` on ``[B, L, hidden]``.

* each prompt chunk (``Segment``) runs as one sequence, ``[1, n, hidden]``, against
  its own per-layer caches: the caches the model's ``make_cache`` asks for (KV,
  rotating KV for sliding windows, arrays for linear attention / SSM state, MLA's
  latent KV), exactly as ``mlx_lm.generate_step`` runs it;
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
from mlx_lm.models.cache import ArraysCache

from stage_worker.packed_forward import DecodeRows, Segment


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
    for segment in segments:
        start, end = segment.row_start, segment.row_start + segment.num_tokens
        outputs.append(run_batch(layers, hidden[start:end][None], segment.caches, array_masks)[0])
        order += segment.rows
    out = mx.concatenate(outputs) if len(outputs) > 1 else outputs[0]
    if order != list(range(len(order))):
        out = out[mx.array(_inverse(order))]
    return out


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
