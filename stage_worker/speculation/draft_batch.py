"""The draft model's KV for the sequences it proposes for: one batch that lasts across proposal rounds.

Contract:
- A ``DraftBatch`` holds, for each layer of the draft, the keys and values of its sequences (one row each,
  ``seq_ids`` in row order) and, on the host, which columns of each row hold one of its tokens (``valid``) and
  how many it holds (``lengths``). A round moves none of the draft's KV: a column a row does not use is a hole
  its attention never sees, so dropping a row's last tokens (``drop_last``) is host bookkeeping.
- ``caches`` are what an mlx-lm model takes as ``cache=``; ``forward(model, tokens, fed)`` runs ``tokens``
  ``[rows, width]`` through the model, row b's first ``fed[b]`` of them real, and returns the lazy logits.
- Sequences join and leave by ``concat`` and ``take``: copies of their KV.
- ``pad_keys`` (the draft on CUDA): masked forwards attend over every column held, so their shapes change only
  as the batch grows.
- No device sync anywhere here: the caller evaluates (``arrays``) once per round.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from stagemesh_core.memory import DRAFT_COLUMN_STEP, DRAFT_HOLES_TO_COMPACT

# Columns are added in steps of this many (as mlx-lm's caches grow), so a growing batch reallocates rarely.
COLUMN_STEP = DRAFT_COLUMN_STEP
# A batch out of columns compacts itself rather than growing when holes are more than this share of them (the
# planner bounds the draft's KV by both: stagemesh_core.memory.draft_kv_columns).
HOLES_TO_COMPACT = DRAFT_HOLES_TO_COMPACT


def _columns_for(needed: int) -> int:
    return -(-needed // COLUMN_STEP) * COLUMN_STEP


class _LayerCache:
    """One layer's keys and values of a ``DraftBatch``, in the interface mlx-lm's attention calls (``offset``,
    ``update_and_fetch``, ``make_mask``)."""

    def __init__(self, batch: DraftBatch) -> None:
        self._batch = batch
        self.keys: mx.array | None = None
        self.values: mx.array | None = None

    @property
    def offset(self) -> mx.array:
        """Each row's position of its first token in this forward (its tokens so far)."""
        return self._batch.offsets

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        start = self._batch.end
        stop = start + keys.shape[2]
        padded = self._batch.padded
        # A padded forward attends over exactly ``capacity`` columns (its mask's width): grow to it.
        if self.keys is None or self.values is None or self.keys.shape[2] < (self._batch.capacity if padded
                                                                             else stop):
            self._grow(keys, values, self._batch.capacity)
        assert self.keys is not None and self.values is not None
        self.keys[..., start:stop, :] = keys
        self.values[..., start:stop, :] = values
        if padded:
            return self.keys, self.values
        return self.keys[..., :stop, :], self.values[..., :stop, :]

    def _grow(self, keys: mx.array, values: mx.array, columns: int) -> None:
        rows, heads, _, key_dim = keys.shape
        held = 0 if self.keys is None else self.keys.shape[2]
        more_keys = mx.zeros((rows, heads, columns - held, key_dim), keys.dtype)
        more_values = mx.zeros((rows, heads, columns - held, values.shape[3]), values.dtype)
        if self.keys is None or self.values is None:
            self.keys, self.values = more_keys, more_values
        else:
            self.keys = mx.concatenate([self.keys, more_keys], axis=2)
            self.values = mx.concatenate([self.values, more_values], axis=2)

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> mx.array | str | None:
        return self._batch.mask(n)


class DraftBatch:
    """The draft's KV of ``seq_ids``, one row each: per layer, keys and values ``[rows, kv_heads, columns,
    head_dim]``.

    A forward writes every row at the same new columns; a column a row does not use (the padding after a
    shorter feed, a rejected proposal dropped by ``drop_last``) is a hole that its attention never sees (the
    mask comes from ``valid``), and a row's positions (the RoPE offsets) count its tokens only. So rows fed
    unequal numbers of tokens need no shifting (mlx-lm's ``BatchKVCache`` keeps rows right-aligned and rolls
    them after a right-padded feed, a copy of the batch).

    With ``pad_keys`` (the draft on CUDA), a forward that needs a mask (several tokens per row, or holes)
    attends over every column the batch holds, the ones past this forward's masked, so the attention's shapes
    change only as the batch grows: MLX's CUDA attention with a mask or several query rows is plain matmuls and
    a softmax, planned per shape (``packed_forward``'s docstring says the same of the stage). A one-token
    forward without holes keeps the unmasked vector kernel, which takes any length.
    """

    def __init__(self, seq_ids: Sequence[int], num_layers: int, pad_keys: bool = False) -> None:
        self.seq_ids = list(seq_ids)
        self.pad_keys = pad_keys
        self.caches = [_LayerCache(self) for _ in range(num_layers)]
        self.valid = np.zeros((len(self.seq_ids), 0), dtype=bool)
        self.lengths = np.zeros(len(self.seq_ids), dtype=np.int64)
        self.end = 0  # columns written so far
        self.offsets = mx.array(self.lengths, dtype=mx.int32)
        self._held_mask: mx.array | None = None  # None: no holes in this forward (mlx-lm's plain masks do)
        self._padded_forward_mask: mx.array | None = None  # a padded forward's whole mask (``_padded_mask``)
        self._rows = {seq_id: row for row, seq_id in enumerate(self.seq_ids)}

    @property
    def padded(self) -> bool:
        """This forward attends over every column held (``pad_keys`` and a mask needed)."""
        return self._padded_forward_mask is not None

    @property
    def capacity(self) -> int:
        return self.valid.shape[1]

    def row(self, seq_id: int) -> int:
        return self._rows[seq_id]

    def arrays(self) -> list[mx.array]:
        """What evaluating the batch's KV evaluates."""
        return [a for c in self.caches for a in (c.keys, c.values) if a is not None]

    def forward(self, model: Any, tokens: mx.array, fed: Sequence[int]) -> mx.array:
        """``model``'s logits for ``tokens`` ``[rows, width]`` (lazy); row b's first ``fed[b]`` tokens are
        its own, the rest padding that becomes holes."""
        width = tokens.shape[1]
        self._reserve(width)
        self.offsets = mx.array(self.lengths, dtype=mx.int32)
        counts = np.asarray(fed, dtype=np.int64)
        holes = not self.valid[:, :self.end].all() or bool((counts < width).any())
        padded = self.pad_keys and (holes or width > 1)
        self._padded_forward_mask = mx.array(self._padded_mask(width)) if padded else None
        self._held_mask = mx.array(self.valid[:, :self.end]) if holes and not padded else None
        logits = model(tokens, cache=self.caches)
        self.valid[:, self.end:self.end + width] = np.arange(width)[None, :] < counts[:, None]
        self.lengths += counts
        self.end += width
        return logits

    def _padded_mask(self, width: int) -> np.ndarray:
        """``bool[rows, 1, width, capacity]``: each new token sees its row's tokens held and the new columns up
        to its own; every column after this forward's is masked."""
        rows = len(self.seq_ids)
        mask = np.zeros((rows, 1, width, self.capacity), dtype=bool)
        mask[:, 0, :, :self.end] = self.valid[:, None, :self.end]
        mask[:, 0, :, self.end:self.end + width] = np.tril(np.ones((width, width), dtype=bool))[None]
        return mask

    def mask(self, n: int) -> mx.array | str | None:
        """Which columns each of ``n`` new tokens per row attends to: the row's tokens held, then the new
        columns up to its own (causal); without holes, mlx-lm's own masks (none for one token, else causal).
        A padded forward's mask spans every column (``_padded_mask``)."""
        if self._padded_forward_mask is not None:
            return self._padded_forward_mask
        if self._held_mask is None:
            return None if n == 1 else "causal"
        rows, held = self._held_mask.shape
        causal = mx.tril(mx.ones((n, n), dtype=mx.bool_))
        return mx.concatenate([mx.broadcast_to(self._held_mask[:, None, None, :], (rows, 1, n, held)),
                               mx.broadcast_to(causal, (rows, 1, n, n))], axis=-1)

    def drop_last(self, row: int, n: int) -> None:
        """Forget row ``row``'s last ``n`` tokens (their columns become holes)."""
        if n <= 0:
            return
        if n > self.lengths[row]:
            raise ValueError(f"sequence {self.seq_ids[row]} holds {self.lengths[row]} draft tokens, not {n} to drop")
        columns = np.flatnonzero(self.valid[row, :self.end])[-n:]
        self.valid[row, columns] = False
        self.lengths[row] -= n
        # Columns no row holds any more at the end are given back (every row dropping as many tokens, a lone row
        # always): the next forward writes over them and no hole is left.
        while self.end and not self.valid[:, self.end - 1].any():
            self.end -= 1

    def take(self, rows: Sequence[int]) -> DraftBatch:
        """A new batch of ``rows`` (in that order), each row's tokens moved to its first columns (holes dropped):
        a copy of their KV, as mlx-lm's ``BatchGenerator`` filters its batch."""
        out = DraftBatch([self.seq_ids[r] for r in rows], len(self.caches), pad_keys=self.pad_keys)
        lengths = self.lengths[list(rows)]
        width = int(lengths.max()) if len(rows) else 0
        out.lengths = lengths.copy()
        out.end = width
        out.valid = np.zeros((len(rows), _columns_for(width)), dtype=bool)
        out.valid[:, :width] = np.arange(width)[None, :] < lengths[:, None]
        if not width or self.caches[0].keys is None:
            return out
        index = np.zeros((len(rows), width), dtype=np.int32)
        for i, r in enumerate(rows):
            columns = np.flatnonzero(self.valid[r, :self.end])
            index[i, :len(columns)] = columns
        gather = mx.array(index)[:, None, :, None]
        picked = mx.array(list(rows), dtype=mx.int32)
        for source, target in zip(self.caches, out.caches):
            assert source.keys is not None and source.values is not None
            keys, values = source.keys[picked], source.values[picked]
            target.keys = mx.take_along_axis(keys, mx.broadcast_to(gather, (*keys.shape[:2], width, 1)), axis=2)
            target.values = mx.take_along_axis(values, mx.broadcast_to(gather, (*values.shape[:2], width, 1)),
                                               axis=2)
        return out

    @classmethod
    def concat(cls, batches: Sequence[DraftBatch]) -> DraftBatch:
        """One batch of every row of ``batches``, in order (holes kept; shorter batches padded with holes): a copy
        of their KV, as mlx-lm's ``BatchGenerator`` extends its batch."""
        out = cls([s for b in batches for s in b.seq_ids], len(batches[0].caches), pad_keys=batches[0].pad_keys)
        end = max(b.end for b in batches)
        out.end = end
        out.lengths = np.concatenate([b.lengths for b in batches])
        out.valid = np.zeros((len(out.seq_ids), _columns_for(end)), dtype=bool)
        row = 0
        for b in batches:
            out.valid[row:row + len(b.seq_ids), :b.end] = b.valid[:, :b.end]
            row += len(b.seq_ids)
        shaped = next((b for b in batches if b.caches[0].keys is not None), None)
        if not end or shaped is None:
            return out
        for layer, target in enumerate(out.caches):
            like = shaped.caches[layer]
            assert like.keys is not None and like.values is not None
            target.keys = mx.concatenate([_columns(b.caches[layer].keys, like.keys, len(b.seq_ids), b.end, end)
                                          for b in batches])
            target.values = mx.concatenate([_columns(b.caches[layer].values, like.values, len(b.seq_ids), b.end,
                                                     end) for b in batches])
        return out

    def _reserve(self, width: int) -> None:
        """Room for ``width`` more columns: holes compacted away when they are a large share, else more columns."""
        needed = self.end + width
        if needed <= self.capacity:
            return
        holes = self.end - int(self.lengths.max(initial=0))
        if holes > HOLES_TO_COMPACT * self.end:
            compact = self.take(range(len(self.seq_ids)))
            self.valid, self.end = compact.valid, compact.end
            for mine, theirs in zip(self.caches, compact.caches):
                mine.keys, mine.values = theirs.keys, theirs.values
            needed = self.end + width
        if needed > self.capacity:
            grown = np.zeros((len(self.seq_ids), _columns_for(needed)), dtype=bool)
            grown[:, :self.capacity] = self.valid
            self.valid = grown


def _columns(array: mx.array | None, like: mx.array, rows: int, used: int, end: int) -> mx.array:
    """``rows`` rows of ``array``'s first ``used`` columns, padded with zero columns to ``end`` (``like``'s heads,
    widths and dtype where ``array`` is None)."""
    if array is None:
        return mx.zeros((rows, like.shape[1], end, like.shape[3]), like.dtype)
    array = array[..., :used, :]
    return array if used == end else mx.pad(array, [(0, 0), (0, 0), (0, end - used), (0, 0)])


__all__ = ["DraftBatch"]
