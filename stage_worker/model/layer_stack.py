"""A stage's slice of any mlx-lm model that is a stack of layers, run as mlx-lm runs it.

Contract: ``stack_layers(layers, hidden, segments, decode, array_masks)`` takes the ``[T, hidden]`` rows of a
packed batch (the wire layout, as ``packed_forward``) and returns this stage's output rows, computed by
mlx-lm's own decoder layers called as each model's ``__call__`` calls them: ``layer(h, mask, cache)`` on
``[B, L, hidden]``. Each prompt chunk (``Segment``) runs as one sequence against its own caches, as
``mlx_lm.generate_step`` runs it, except chunks that can run together (``batch_groups``), which run as one
batch, as mlx-lm's ``BatchGenerator`` processes prompts; the decode group (``DecodeRows``) runs as one batch
against the group's batch caches, as ``BatchGenerator`` decodes. Every row gets exactly mlx-lm's arithmetic:
a batched row differs from its sequence alone only by masked positions. Each layer's mask comes from its own
cache, as the models decide (``layer_mask``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask, create_ssm_mask
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from stage_worker.cache.kv_store import extract_row
from stage_worker.model.packed_forward import DecodeRows, Segment

# Padding a batch of chunks may add, as a share of its real positions (``batch_groups``).
MAX_PADDING = 0.1


def stack_layers(layers: Sequence[nn.Module], hidden: mx.array, segments: Sequence[Segment],
                 decode: DecodeRows | None, array_masks: bool) -> mx.array:
    """``[T, hidden]`` -> ``[T, hidden]`` through ``layers`` (lazy); segments and decode rows cover the rows.

    A prompt chunk alone runs as ``[1, n, hidden]`` against the caches the model's ``make_cache`` asks for (KV,
    rotating KV for sliding windows, arrays for linear attention / SSM state, MLA's latent KV). The decode
    group runs as one ``[B, W, hidden]`` batch (one token each, or a speculative verification's ``W`` with the
    others right-padded) against the group's batch caches (``BatchKVCache``, ``BatchRotatingKVCache``, a
    batched ``ArraysCache``: left-padded, per-row offsets): every per-row part of a layer, the expert routing
    included, runs once for the whole group.
    """
    outputs: list[mx.array] = []
    order: list[int] = []
    if decode is not None:
        gather, real = decode.padded_rows()
        h = hidden[mx.array(gather)].reshape(decode.sequences, decode.width, -1)
        out = run_batch(layers, h, decode.caches, array_masks).reshape(len(gather), -1)
        outputs.append(out if real is None else out[mx.array(real)])
        order += decode.rows
    together: set[int] = set()
    for group in batch_groups([s for s in segments if _batchable(s.caches)]):
        outputs.append(_run_together(layers, hidden, group, array_masks))
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


def held_positions(segment: Segment) -> int:
    """The positions a chunk's caches hold before it (0 for a first chunk): what merging pads to."""
    return max((cache.size() for cache in segment.caches), default=0)


def batch_groups(chunks: Sequence[Segment], max_padding: float = MAX_PADDING) -> list[list[Segment]]:
    """Chunks that run as one batch, longest first; groups of two or more only (a chunk alone runs as it is).

    A group pads every chunk to its longest chunk (padding that costs as much as real positions in every
    projection and expert) and every cache to its longest history (padding that attention reads): each
    padding is at most ``max_padding`` of the real positions it pads, so first chunks (no history) group
    only with first chunks, and a later chunk only with chunks whose sequences reached nearly as far."""
    groups: list[list[Segment]] = []
    for chunk in sorted(chunks, key=lambda s: (-s.num_tokens, -held_positions(s))):
        for group in groups:
            if _padding_fits(group + [chunk], max_padding):
                group.append(chunk)
                break
        else:
            groups.append([chunk])
    return [group for group in groups if len(group) > 1]


def _padding_fits(group: Sequence[Segment], max_padding: float) -> bool:
    for size in (lambda s: s.num_tokens, held_positions):
        sizes = [size(s) for s in group]
        if len(sizes) * max(sizes) - sum(sizes) > max_padding * sum(sizes):
            return False
    return True


def _batchable(caches: Sequence[Any]) -> bool:
    """Caches whose batch forms merge, continue and extract a sequence exactly (mlx-lm's ``merge``,
    ``prepare``/``finalize`` and ``extract``). A rotating cache that keeps its first positions (``keep``) has
    a batch form that does not keep them; chunked, quantized and listed caches have none that continues: their
    sequences' chunks run one at a time."""
    return all(type(c) in (KVCache, ArraysCache) or (type(c) is RotatingKVCache and c.keep == 0)
               for c in caches)


def _run_together(layers: Sequence[nn.Module], hidden: mx.array, group: Sequence[Segment],
                  array_masks: bool) -> mx.array:
    """Several sequences' chunks as one right-padded ``[B, L, hidden]`` batch against their caches merged
    (as mlx-lm's ``BatchGenerator`` processes prompts), each sequence's caches then extracted back into its
    own; the chunks' output rows, in ``group`` order.

    The caches are merged into batch caches of the same kinds (``merge``: left-padded to the longest history),
    the chunks right-padded to the longest (``prepare(lengths, right_padding)``: causality keeps every real
    position from seeing the padding after it, and a linear-attention state stops at each row's length), the
    padding then rolled to the left (``finalize``). The KV store keeps a prefilling sequence alone, so each
    sequence's caches are extracted back (``kv_store.extract_row``: a ``BatchKVCache`` row without reading the
    device).
    """
    lengths = [s.num_tokens for s in group]
    length = max(lengths)
    padding = [length - n for n in lengths]
    pad_row = hidden.shape[0]  # a zero row appended below: what the padded positions read
    index = [list(s.rows) + [pad_row] * pad for pad, s in zip(padding, group)]
    padded = mx.concatenate([hidden, mx.zeros((1, hidden.shape[1]), hidden.dtype)])[mx.array(index)]
    # What each sequence's cache of each layer holds after its chunk: its row's last columns, once the padding
    # is rolled to the left.
    held_after = [[s.caches[layer].size() + s.num_tokens for s in group] for layer in range(len(group[0].caches))]
    # Merging copies each history once (and extracting once more): less than the chunk's attention reads over
    # it, by the chunk's length, so the batch is worth it for any chunk longer than a few positions.
    caches = [type(kind).merge([s.caches[layer] for s in group]) for layer, kind in enumerate(group[0].caches)]
    if any(padding):
        for cache in caches:
            cache.prepare(lengths=lengths, right_padding=padding)
    out = run_batch(layers, padded, caches, array_masks)
    for layer, cache in enumerate(caches):
        if any(padding):
            cache.finalize()
        for b, segment in enumerate(group):
            # Without a device read (a kernel launcher may be evaluating the previous step: engine.launcher).
            vars(segment.caches[layer]).update(vars(extract_row(cache, b, held_after[layer][b])))
    return out.reshape(-1, out.shape[-1])[mx.array([b * length + j for b, n in enumerate(lengths)
                                                    for j in range(n)])]


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
    """The mask mlx-lm's models build for a layer holding ``cache``, for input ``h`` of ``[B, L, hidden]``.

    As the models decide (each builds one mask per kind of cache, from a cache of that kind): a layer with an
    ``ArraysCache`` gets ``create_ssm_mask`` from it, any other ``create_attention_mask`` (a rotating cache
    applies its window). ``array_masks``: the model's attention needs the mask as an array, never the
    ``"causal"`` shortcut (MLA adds the mask to its rotary scores; ``mlx_arch.needs_array_masks``).
    """
    if isinstance(cache, ArraysCache):
        return create_ssm_mask(h, cache)
    return create_attention_mask(h, cache, return_array=array_masks)


def _inverse(order: Sequence[int]) -> list[int]:
    inverse = [0] * len(order)
    for position, row in enumerate(order):
        inverse[row] = position
    return inverse
