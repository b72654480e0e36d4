"""Packed forward: many sequences' rows through a stage's decoder layers in one pass.

A batch arrives as ``[T, hidden]`` rows, sequence after sequence (the wire layout). ``packed_layers`` runs
everything that is per row (norms, the q/k/v and output projections, the MLP) once over all ``T`` rows, and
attention in three shapes, each as few MLX ops as its sequences allow: a decode group as one batch over its
``BatchKVCache`` (``DecodeRows``, ``kv_store``), fresh prompts of similar length as one right-padded causal
batch (``fresh_prompt_groups``), and any other chunk over its own mlx-lm ``KVCache`` (``Segment``).

The modules are mlx-lm's own (``TransformerBlock`` of llama / qwen2 / qwen3), their projections possibly
joined by ``fused_projections``; this file only reorders their calls. Results depend on the batch's
composition only through GEMM blocking, which is why parity compares runs with identical batches and
batched-vs-unbatched checks compare greedy tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import BatchKVCache, KVCache

from stage_worker.cache.quantized_kv import kv_columns
from stage_worker.model import masked_decode_kernel
from stage_worker.model.fused_projections import attention_projections, feed_forward


@dataclass(frozen=True)
class Segment:
    """One sequence's prompt chunk: its rows in the packed batch and its standalone caches."""

    caches: Sequence[KVCache]
    num_tokens: int
    row_start: int = 0

    @property
    def rows(self) -> range:
        return range(self.row_start, self.row_start + self.num_tokens)


@dataclass(frozen=True)
class DecodeRows:
    """A decode group's step: each sequence's tokens (one; a verification's several) and per-layer batch caches."""

    rows: list[int]  # the group's rows of the batch, sequence after sequence (mx.array takes a list, not any Sequence)
    caches: Sequence[BatchKVCache]
    lengths: tuple[int, ...] = ()  # each sequence's token count, in order; empty: one each

    @property
    def sequences(self) -> int:
        return len(self.lengths) if self.lengths else len(self.rows)

    @property
    def width(self) -> int:
        """Tokens every sequence runs in the step (the shorter right-padded)."""
        return max(self.lengths, default=1)

    def padded_rows(self) -> tuple[list[int], list[int] | None]:
        """The ``[sequences * width]`` batch rows of the padded step and where its real rows sit (``right_padded``;
        a sequence's rows are contiguous in the batch)."""
        lengths = self.lengths or (1,) * len(self.rows)
        starts = accumulate(lengths[:-1], initial=0)  # each sequence's first place in ``rows``
        return right_padded([(self.rows[start], n) for start, n in zip(starts, lengths)], self.width)


def right_padded(spans: Sequence[tuple[int, int]], width: int) -> tuple[list[int], list[int] | None]:
    """Sequences' runs of batch rows (first row, count) laid out ``width`` rows each (pure): the batch rows to
    gather, a short run's padding repeating its last row, and the real rows' places in that layout (None when
    nothing is padded)."""
    gather = [first + min(t, count - 1) for first, count in spans for t in range(width)]
    if all(count == width for _, count in spans):
        return gather, None
    return gather, [i * width + t for i, (_, count) in enumerate(spans) for t in range(count)]


@dataclass(frozen=True)
class _FreshGroup:
    """Fresh prompts attended together, right-padded to ``length`` rows each."""

    segments: Sequence[Segment]
    length: int
    gather: mx.array  # [n * length] batch rows; padding repeats a sequence's last row
    real: mx.array | None  # positions of the real rows in the padded [n * length]; None: no padding


# A prompt joins a group whose shortest member is within this many tokens (or a quarter of its
# length): padding costs compute, a separate attention costs ~10 small ops per layer.
_PAD_TOKENS = 8


def packed_layers(
    layers: Sequence[nn.Module], hidden: mx.array, segments: Sequence[Segment], decode: DecodeRows | None = None,
    pad_keys: bool = False, fused_decode: bool = False,
) -> mx.array:
    """``[T, hidden]`` -> ``[T, hidden]`` through ``layers`` (lazy); segments and decode rows cover the rows.
    ``layers`` are mlx-lm ``TransformerBlock``s: ``self_attn.{q,k,v,o}_proj``, optional ``q_norm`` /
    ``k_norm``, ``rope``, ``mlp`` and the two RMS norms.

    ``pad_keys`` (a stage on CUDA): a chunk of several rows attends over its cache's whole buffer (mlx-lm grows
    it 256 positions at a time), the positions past its history masked. MLX's CUDA attention for more than one
    query row is plain matmuls and a softmax, whose kernels are planned per shape, and a history one longer
    every step would be a new shape at every step of every layer; the buffer's length changes once in 256
    positions. Masked positions weigh exactly zero, so the rows' results are those over the history alone. A
    decode group of several tokens each does the same over its batch buffer.
    ``fused_decode``: a one-token decode group attends through ``masked_decode_kernel`` where it applies."""
    fresh, others = fresh_prompt_groups(segments)
    # attention outputs come out unit by unit: decode group, fresh prompt groups, other chunks
    order = ([*decode.rows] if decode else []) + [r for g in fresh for s in g.segments for r in s.rows] + \
        [r for s in others for r in s.rows]
    restore = None if order == list(range(len(order))) else mx.array(_inverse(order))
    # The group's rows and causal mask are the same in every layer (its caches move in step): made once.
    shared = _DecodeShared.of(decode, fused_decode) if decode is not None else None
    padded = _PaddedMasks() if pad_keys else None
    h = hidden
    for index, layer in enumerate(layers):
        h = h + _attention(layer.self_attn, layer.input_layernorm(h), fresh, others, decode, index, restore, shared,
                           padded)
        h = h + feed_forward(layer.mlp, layer.post_attention_layernorm(h))
    return h


def fresh_prompt_groups(segments: Sequence[Segment]) -> tuple[list[_FreshGroup], list[Segment]]:
    """Fresh chunks (empty caches) of similar length, grouped (two or more each), and the rest."""
    # Quantized KV (``--kv-cache-dtype``) is attended quantized, as each chunk's own positions are once written:
    # such chunks take the cache's path, never this one's attention over the unquantized keys.
    fresh = sorted((s for s in segments if s.caches[0].offset == 0 and not hasattr(s.caches[0], "bits")),
                   key=lambda s: s.num_tokens)
    buckets: list[list[Segment]] = []
    for segment in fresh:
        if buckets and segment.num_tokens <= _pad_limit(buckets[-1][0].num_tokens):
            buckets[-1].append(segment)
        else:
            buckets.append([segment])
    groups = [_fresh_group(bucket) for bucket in buckets if len(bucket) > 1]
    grouped = {id(s) for g in groups for s in g.segments}
    return groups, [s for s in segments if id(s) not in grouped]


def _pad_limit(shortest: int) -> int:
    return shortest + max(_PAD_TOKENS, shortest // 4)


def _fresh_group(segments: Sequence[Segment]) -> _FreshGroup:
    length = max(s.num_tokens for s in segments)
    gather, real = right_padded([(s.row_start, s.num_tokens) for s in segments], length)
    return _FreshGroup(tuple(segments), length, mx.array(gather), None if real is None else mx.array(real))


def _inverse(order: Sequence[int]) -> list[int]:
    inverse = [0] * len(order)
    for position, row in enumerate(order):
        inverse[row] = position
    return inverse


@dataclass(frozen=True)
class _DecodeShared:
    """What every layer's decode attention shares within one step."""

    rows: mx.array | slice  # the padded step's rows of the batch: a slice when they are contiguous (no gather)
    mask: mx.array | None  # BatchKVCache.make_mask gives an array (or None with nothing to mask)
    real: mx.array | None  # the real rows among the padded step's (None: no padding)
    buffer_masks: dict[int, mx.array] = field(default_factory=dict)  # ``mask`` over whole buffers, by length
    # One-token steps through ``masked_decode_kernel``: the step's end column after its append (every layer's
    # cache moves in step); None where the step attends through mlx-lm's masked attention.
    fused_end: mx.array | None = None

    @classmethod
    def of(cls, decode: DecodeRows, fused: bool) -> _DecodeShared:
        gather, real = decode.padded_rows()
        first, count = gather[0], len(gather)
        contiguous = gather == list(range(first, first + count))
        rows: mx.array | slice = slice(first, first + count) if contiguous else mx.array(gather)
        cache = decode.caches[0]
        fused_end = mx.array([cache._idx + 1], dtype=mx.int32) if fused and decode.width == 1 else None
        return cls(rows, cache.make_mask(decode.width), None if real is None else mx.array(real), fused_end=fused_end)

    def over_buffer(self, buffer: int) -> mx.array:
        """``mask`` widened to a whole buffer of ``buffer`` columns, the columns past the step masked."""
        assert self.mask is not None
        if buffer not in self.buffer_masks:
            shape = (*self.mask.shape[:-1], buffer - self.mask.shape[-1])
            self.buffer_masks[buffer] = mx.concatenate([self.mask, mx.zeros(shape, dtype=mx.bool_)], axis=-1)
        return self.buffer_masks[buffer]


class _PaddedMasks:
    """Causal masks of chunks attending over a whole cache buffer, made once per step for every layer (each
    layer's cache of a sequence has the same length and buffer)."""

    def __init__(self) -> None:
        self._made: dict[tuple[int, int, int], mx.array] = {}

    def mask(self, end: int, rows: int, buffer: int) -> mx.array:
        """``bool[rows, buffer]``: row i (position ``end - rows + i``) sees positions up to its own."""
        key = (end, rows, buffer)
        if key not in self._made:
            positions = mx.arange(end - rows, end)[:, None]
            self._made[key] = mx.arange(buffer)[None] <= positions
        return self._made[key]


def _attention(attn: nn.Module, x: mx.array, fresh: Sequence[_FreshGroup], others: Sequence[Segment],
               decode: DecodeRows | None, layer_index: int, restore: mx.array | None,
               shared: _DecodeShared | None = None, padded: _PaddedMasks | None = None) -> mx.array:
    queries, keys, values = attention_projections(attn, x)
    if hasattr(attn, "q_norm"):  # qwen3 normalizes per head before RoPE
        queries, keys = attn.q_norm(queries), attn.k_norm(keys)
    outputs = []
    if decode is not None:
        outputs.append(_decode_attention(attn, queries, keys, values, decode, layer_index,
                                         shared or _DecodeShared.of(decode, False), padded is not None))
    for group in fresh:
        outputs.append(_fresh_prompts_attention(attn, queries, keys, values, group, layer_index))
    for segment in others:
        start, end = segment.row_start, segment.row_start + segment.num_tokens
        cache = segment.caches[layer_index]
        # [n, heads, dim] -> [1, heads, n, dim], mlx-lm's attention layout. Each op here is host time on a
        # GPU's token path (a lone decode is this loop); a slice of every row is no op in MLX.
        q, k, v = (a[start:end][None].transpose(0, 2, 1, 3) for a in (queries, keys, values))
        # What mlx-lm's create_attention_mask asks a KVCache for, without slicing rows to pass their shape.
        mask = cache.make_mask(segment.num_tokens, return_array=False, window_size=None)
        q = attn.rope(q, offset=cache.offset)
        k = attn.rope(k, offset=cache.offset)
        k, v = cache.update_and_fetch(k, v)
        if padded is not None and segment.num_tokens > 1:
            # The whole buffer (its shape changes once in 256 positions), the positions past the history masked.
            k, v = cache.keys, cache.values
            mask = padded.mask(cache.offset, segment.num_tokens, kv_columns(k))
        out = scaled_dot_product_attention(q, k, v, cache=cache, scale=attn.scale, mask=mask)
        outputs.append(out.transpose(0, 2, 1, 3).reshape(segment.num_tokens, -1))
    out = mx.concatenate(outputs) if len(outputs) > 1 else outputs[0]
    if restore is not None:
        out = out[restore]
    return attn.o_proj(out)


def _fresh_prompts_attention(attn: nn.Module, queries: mx.array, keys: mx.array, values: mx.array,
                             group: _FreshGroup, layer_index: int) -> mx.array:
    """``n`` fresh prompts right-padded to ``L`` rows: one causal attention over ``[n, heads, L, dim]``,
    then each sequence's real keys and values written into its own cache; the real rows out. They have no
    history, and causality keeps every real row from seeing the padding after it."""
    n, length = len(group.segments), group.length
    q = queries[group.gather].reshape(n, length, attn.n_heads, -1).transpose(0, 2, 1, 3)
    k = keys[group.gather].reshape(n, length, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    v = values[group.gather].reshape(n, length, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    q = attn.rope(q, offset=0)
    k = attn.rope(k, offset=0)
    for i, segment in enumerate(group.segments):
        size = segment.num_tokens
        segment.caches[layer_index].update_and_fetch(k[i : i + 1, :, :size], v[i : i + 1, :, :size])
    # mlx-lm annotates ``mask`` as an array only, but passes "causal" through to mx.fast, as mlx-lm itself does.
    out = scaled_dot_product_attention(q, k, v, cache=None, scale=attn.scale,
                                       mask="causal" if length > 1 else None)  # type: ignore[arg-type]
    out = out.transpose(0, 2, 1, 3).reshape(n * length, -1)
    return out if group.real is None else out[group.real]


def _decode_attention(attn: nn.Module, queries: mx.array, keys: mx.array, values: mx.array,
                      decode: DecodeRows, layer_index: int, shared: _DecodeShared, pad_keys: bool) -> mx.array:
    """mlx-lm's own attention on ``[B, heads, W, dim]`` against the group's ``BatchKVCache``:
    per-row RoPE offsets, one append and one masked attention for the whole group; the real rows out.
    Sequences with fewer than ``W`` tokens are right-padded: causality keeps every real row from seeing the
    padding after it, and the store drops the padded columns afterwards.
    ``pad_keys``: a step of several tokens attends over the whole buffer (as ``packed_layers`` says)."""
    cache = decode.caches[layer_index]
    width = decode.width
    if width == 1:
        q = queries[shared.rows][:, :, None, :]
        k = keys[shared.rows][:, :, None, :]
        v = values[shared.rows][:, :, None, :]
    else:
        q, k, v = (a[shared.rows].reshape(decode.sequences, width, *a.shape[1:]).transpose(0, 2, 1, 3)
                   for a in (queries, keys, values))
    mask: mx.array | None = shared.mask
    q = attn.rope(q, offset=cache.offset)
    k = attn.rope(k, offset=cache.offset)
    k, v = cache.update_and_fetch(k, v)
    if (shared.fused_end is not None and cache.keys is not None and cache.values is not None
            and not hasattr(cache, "bits") and masked_decode_kernel.supported(q, cache.keys)):
        # The whole buffers, each row's window [left padding, end): what the mask below would leave visible.
        out = masked_decode_kernel.attend(q, cache.keys, cache.values, cache.left_padding, shared.fused_end,
                                          attn.scale)
        return out.reshape(out.shape[0], -1)
    if pad_keys and width > 1 and cache.keys is not None and cache.values is not None:
        k, v = cache.keys, cache.values
        mask = shared.over_buffer(kv_columns(k))
    out = scaled_dot_product_attention(q, k, v, cache=cache, scale=attn.scale, mask=mask)
    if width == 1:
        return out.reshape(out.shape[0], -1)
    out = out.transpose(0, 2, 1, 3).reshape(decode.sequences * width, -1)
    return out if shared.real is None else out[shared.real]
