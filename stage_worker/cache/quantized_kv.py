"""Quantized keys and values (``--kv-cache-dtype q8|q4``): a sequence's cache and a decode group's batch form.

Contract: ``SequenceQuantizedKVCache`` is mlx-lm's ``QuantizedKVCache`` (every position's keys and values
stored by ``mx.quantize`` as packed codes with a scale and a bias per ``group_size`` elements, attended by
mlx-lm's ``quantized_scaled_dot_product_attention``) with the one thing mlx-lm lacks for continuous batching:
a batch form. ``BatchQuantizedKVCache`` is to it what mlx-lm's ``BatchKVCache`` is to ``KVCache``: rows
left-padded to a common end ``_idx``, per-row ``offset`` and ``left_padding``, ``merge`` / ``extend`` /
``filter`` / ``extract`` / ``trim`` / ``make_mask`` with the same meaning, its ``keys`` and ``values`` each a
(codes, scales, biases) triple instead of one array. Quantization is per position (groups run along the head
dimension), so a position's codes are the same whether it was written alone, in a chunk or in a batch, and
moving rows between the two forms copies codes without requantizing. ``kv_map`` applies an array operation
to a cache's keys or values of either kind, so the KV store handles both with one code path.

Only a plain KV layer quantizes: mlx-lm has no quantized sliding window (``RotatingKVCache.to_quantized``
raises) and a recurrent state has no positions; ``quantized_caches`` swaps the plain ones and leaves the rest.
"""

# mlx-lm's BatchKVCache leaves ``keys``/``values`` unannotated (inferred None) and ``tolist`` returns a union:
# this batch form keeps (codes, scales, biases) triples there and reads the left padding as ints.
# mypy: disable-error-code="assignment,call-overload,type-var,arg-type,operator,index"

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache, dynamic_roll

from stagemesh_core.kv_cache_dtype import KVCacheDtype

# A layer cache whose positions are plain keys and values (cut, copied, rolled back at any position).
PLAIN_SEQUENCE_CACHES = (KVCache, QuantizedKVCache)


def kv_map(fn: Callable[[mx.array], mx.array], keys_or_values: Any) -> Any:
    """``fn`` on a cache's keys (or values): one array, or each of a quantized cache's three."""
    if isinstance(keys_or_values, tuple):
        return tuple(fn(part) for part in keys_or_values)
    return fn(keys_or_values)


def kv_arrays(cache: Any) -> list[mx.array]:
    """The arrays a plain cache's keys and values are made of (none while empty)."""
    out: list[mx.array] = []
    for part in (cache.keys, cache.values):
        if part is not None:
            out += list(part) if isinstance(part, tuple) else [part]
    return out


def kv_columns(keys_or_values: Any) -> int:
    """Positions a buffer has room for (axis 2 of each of its arrays)."""
    first = keys_or_values[0] if isinstance(keys_or_values, tuple) else keys_or_values
    return int(first.shape[2])


class SequenceQuantizedKVCache(QuantizedKVCache):
    """mlx-lm's ``QuantizedKVCache`` for one sequence, which merges into a ``BatchQuantizedKVCache``."""

    def size(self) -> int:
        return self.offset

    @classmethod
    def merge(cls, caches: Sequence[SequenceQuantizedKVCache]) -> BatchQuantizedKVCache:
        return BatchQuantizedKVCache.merge(caches)


class BatchQuantizedKVCache(BatchKVCache):
    """Quantized keys and values of a decode group (see the module docstring). A subclass of mlx-lm's
    ``BatchKVCache`` so that every rule for plain batch KV (trimming, rolling back, prefix entries) applies;
    ``bits`` and ``group_size`` make mlx-lm's attention take its quantized path."""

    def __init__(self, left_padding: list[int], group_size: int, bits: int) -> None:
        super().__init__(left_padding)
        self.group_size = group_size
        self.bits = bits

    def _empty_buffer(self, rows: int, heads: int, columns: int, dim: int, dtype: mx.Dtype) -> tuple[mx.array, ...]:
        per_word = 32 // self.bits
        return (mx.zeros((rows, heads, columns, dim // per_word), dtype=mx.uint32),
                mx.zeros((rows, heads, columns, dim // self.group_size), dtype=dtype),
                mx.zeros((rows, heads, columns, dim // self.group_size), dtype=dtype))

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        prev, steps = self._idx, keys.shape[2]
        if self.keys is None or prev + steps > kv_columns(self.keys):
            rows, heads = keys.shape[:2]
            columns = (self.step + steps - 1) // self.step * self.step
            new_keys = self._empty_buffer(rows, heads, columns, keys.shape[3], keys.dtype)
            new_values = self._empty_buffer(rows, heads, columns, values.shape[3], values.dtype)
            if self.keys is None:
                self.keys, self.values = new_keys, new_values
            else:
                if prev % self.step:
                    self.keys, self.values = tree_map(lambda a: a[..., :prev, :], (self.keys, self.values))
                self.keys = tuple(mx.concatenate([a, b], axis=2) for a, b in zip(self.keys, new_keys))
                self.values = tuple(mx.concatenate([a, b], axis=2) for a, b in zip(self.values, new_values))
        self.offset = self.offset + steps
        self._idx += steps
        quantized_keys = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        quantized_values = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        for buffer, part in zip(self.keys, quantized_keys):
            buffer[..., prev:self._idx, :] = part
        for buffer, part in zip(self.values, quantized_values):
            buffer[..., prev:self._idx, :] = part
        return self.keys_and_values()

    def keys_and_values(self) -> tuple[Any, Any]:
        end = self._idx
        return tree_map(lambda a: a[..., :end, :], (self.keys, self.values))

    def finalize(self) -> None:
        if self._right_padding is not None:
            padding = self._right_padding
            self.keys, self.values = tree_map(lambda a: dynamic_roll(a, padding[:, None], axis=2),
                                              (self.keys, self.values))
            self.offset = self.offset - padding
            self.left_padding += padding
            self._right_padding = None

    @property
    def state(self) -> tuple[Any, ...]:
        return self.keys, self.values, self.offset, self.left_padding, self._idx, self.group_size, self.bits

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        self.keys, self.values, self.offset, self.left_padding, self._idx, self.group_size, self.bits = v

    def filter(self, batch_indices: mx.array) -> None:
        if self.keys is not None:
            self.keys, self.values = tree_map(lambda a: a[batch_indices], (self.keys, self.values))
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        least = min(self.left_padding.tolist())  # as mlx-lm's BatchKVCache.filter (the KV store avoids this read)
        if least > 0:
            if self.keys is not None:
                self.keys, self.values = tree_map(lambda a: a[..., least:, :], (self.keys, self.values))
            self._idx -= least
            self.left_padding -= least

    def extend(self, other: BatchQuantizedKVCache) -> None:
        """Append ``other``'s rows, both right-justified at the longer end (as ``BatchKVCache.extend``)."""
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        end = max(self._idx, other._idx)
        columns = max(kv_columns(c.keys) for c in (self, other) if c.keys is not None)
        template = self if self.keys is not None else other

        def justified(cache: BatchQuantizedKVCache) -> tuple[Any, Any, mx.array]:
            left = end - cache._idx
            if cache.keys is None:
                rows = cache.offset.shape[0]
                keys = tuple(mx.zeros((rows, a.shape[1], 0, a.shape[3]), a.dtype) for a in template.keys)
                values = tuple(mx.zeros((rows, a.shape[1], 0, a.shape[3]), a.dtype) for a in template.values)
            else:
                keys, values = cache.keys, cache.values
            right = columns - kv_columns(keys) - left

            def fit(a: mx.array) -> mx.array:
                if right < 0:
                    a = a[..., :right, :]
                pad = [(0, 0), (0, 0), (left, max(right, 0)), (0, 0)]
                return mx.pad(a, pad) if left or right > 0 else a

            return tree_map(fit, keys), tree_map(fit, values), cache.left_padding + left

        (k1, v1, p1), (k2, v2, p2) = justified(self), justified(other)
        self.keys = tuple(mx.concatenate([a, b]) for a, b in zip(k1, k2))
        self.values = tuple(mx.concatenate([a, b]) for a, b in zip(v1, v2))
        self.offset = mx.concatenate([self.offset, other.offset])
        self.left_padding = mx.concatenate([p1, p2])
        self._idx = end

    def extract(self, idx: int) -> SequenceQuantizedKVCache:
        cache = SequenceQuantizedKVCache(self.group_size, self.bits)
        padding = self.left_padding.tolist()[idx]
        end = self._idx
        cache.keys, cache.values = tree_map(lambda a: mx.contiguous(a[idx:idx + 1, :, padding:end]),
                                            (self.keys, self.values))
        cache.offset = end - padding
        return cache

    @classmethod
    def merge(cls, caches: Sequence[QuantizedKVCache]) -> BatchQuantizedKVCache:
        """One batch of these sequences' caches, left-padded to the longest (as ``BatchKVCache.merge``)."""
        group_size, bits = caches[0].group_size, caches[0].bits
        if any((c.group_size, c.bits) != (group_size, bits) for c in caches):
            raise ValueError("quantized caches of different bits or group sizes cannot share a batch")
        lengths = [c.offset for c in caches]
        longest = max(lengths)
        batch = cls([longest - n for n in lengths], group_size, bits)
        if longest == 0:
            return batch
        sample = next(c for c in caches if c.keys is not None)

        def gathered(part_of: Callable[[QuantizedKVCache], Any]) -> tuple[mx.array, ...]:
            parts = []
            for index, template in enumerate(part_of(sample)):
                buffer = mx.zeros((len(caches), template.shape[1], longest, template.shape[3]), template.dtype)
                for row, (cache, n) in enumerate(zip(caches, lengths)):
                    if n:
                        buffer[row:row + 1, :, longest - n:] = part_of(cache)[index][..., :n, :]
                parts.append(buffer)
            return tuple(parts)

        batch.keys, batch.values = gathered(lambda c: c.keys), gathered(lambda c: c.values)
        batch.offset = batch.offset + longest
        batch._idx = longest
        return batch

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in kv_arrays(self))


def quantized_caches(caches: Sequence[Any], kv_dtype: KVCacheDtype) -> list[Any]:
    """A sequence's fresh caches with every plain KV layer quantized as ``kv_dtype`` says (the others as they
    are: a sliding window, a recurrent state); ``caches`` themselves when ``kv_dtype`` keeps the compute
    dtype."""
    if kv_dtype.bits is None:
        return list(caches)
    return [SequenceQuantizedKVCache(kv_dtype.group_size, kv_dtype.bits) if type(cache) is KVCache else cache
            for cache in caches]
