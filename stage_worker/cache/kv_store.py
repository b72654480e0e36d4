"""KV caches of one stage's own layers, per sequence and per decoding group.

Contract: ``KVStore`` keeps the keys and values of this stage's layers only (never another stage's), for every
sequence the batches' records name. ``for_chunk`` gives a sequence's own caches for a prompt chunk or a
verification; ``for_decode`` gives per-layer batch caches holding exactly a decode batch's sequences, in its
order; ``release_many`` frees sequences; ``retain`` and ``evict`` keep and drop prefix entries, which a new
sequence starts from. A chunk must continue its sequence exactly where this stage's cache ends
(``WireMismatchError`` otherwise), except a rollback of rejected proposals. Only models whose every layer
holds a plain ``KVCache`` (``mlx_arch.ArchFacts.exact_prefix_reuse``) roll back or keep a prefix's first
positions; the others' entries are whole end states, restored whole. Every
stage obeys the same records in the same order, so all stages make the same changes and hold the same
entries. ``extract_row`` takes one row of a batch cache out without reading the device.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, dynamic_roll

from stage_worker.batch import WireMismatchError
from stage_worker.cache.prefix_cache import PrefixCacheCounts
from stage_worker.cache.quantized_kv import PLAIN_SEQUENCE_CACHES, SequenceQuantizedKVCache, kv_arrays, kv_map


@dataclass
class _Group:
    members: list[int]
    caches: list[Any]  # per layer: a BatchKVCache, or another of mlx-lm's batch caches
    # Columns at the end of a member's row that are not its positions (a wider step's right padding, rolled-back
    # proposals), dropped by ``KVStore._settle`` before the columns are next read or changed.
    trims: dict[int, int] = field(default_factory=dict)


def extract_row(batch: Any, index: int, held: int) -> Any:
    """Row ``index`` of a batch cache as the sequence's own cache. A ``BatchKVCache`` row becomes a ``KVCache``
    of the ``held`` positions it holds, its last ``held`` columns before ``_idx``, without reading the device
    (mlx-lm's ``extract`` reads the left padding back); other kinds use mlx-lm's ``extract``. ``KVStore`` takes
    members out of a group with it, ``stage_worker.model.layer_stack`` the prompt chunks it batches."""
    if not isinstance(batch, BatchKVCache):
        return batch.extract(index)
    cache: Any = (SequenceQuantizedKVCache(*_quantization(batch))
                  if hasattr(batch, "bits") else KVCache())
    if batch.keys is not None and batch.values is not None and held:
        start, end = batch._idx - held, batch._idx

        def row(a: mx.array) -> mx.array:
            return mx.contiguous(a[index : index + 1, :, start:end])

        cache.keys, cache.values = kv_map(row, batch.keys), kv_map(row, batch.values)
        cache.offset = held
    return cache


class KVStore:
    """The KV of this stage's layers for every sequence it holds, standalone or in a decode group.

    A sequence starts *standalone*, one mlx-lm cache per layer of the kind the model asks for
    (``StageModel.new_caches``: ``KVCache``, a ``RotatingKVCache`` for a sliding window, an ``ArraysCache`` for
    linear attention), while its prompt is prefilled (in one or several chunks). Sequences that decode together
    are kept in a *decode group*: one mlx-lm batch cache per layer holding all of them (``KVCache.merge`` ->
    ``BatchKVCache``, ``RotatingKVCache.merge`` -> ``BatchRotatingKVCache``, ``ArraysCache.merge``: left-padded,
    per-row offsets), so a decode step appends to and attends over the whole group in a few ops instead of a
    few ops per sequence. Groups follow the batches (``_regroup``).

    Positions are tracked here too: a chunk must continue its sequence exactly where this stage's cache ends,
    so a stage that missed a message fails loudly instead of attending to the wrong positions. The one
    exception is a rollback (``_rewind``).
    """

    def __init__(self, make_caches: Callable[[], list[Any]], max_sequences: int) -> None:
        self._make_caches = make_caches
        self._max_sequences = max_sequences
        # Starts the evaluation of a prefix entry's copies without waiting for it: ``mx.async_eval``, or where a
        # kernel launcher evaluates the stage's steps, its ``launch`` (``stage_worker.engine.launcher``).
        self.evaluate_later: Callable[[Sequence[mx.array]], object] = _async_eval
        self._standalone: dict[int, list[KVCache]] = {}
        self._group_of: dict[int, _Group] = {}
        self._positions: dict[int, int] = {}
        # Positions held across all sequences, kept as one int so another thread (the gRPC
        # service's stats) can read it without iterating a dict this thread is changing.
        self.tokens_held = 0
        self._prefixes: dict[int, list[Any]] = {}  # prefix entry id -> its caches
        self._prefix_tokens: dict[int, int] = {}  # prefix entry id -> the positions it holds
        self.prefix_queried_tokens = 0  # prompt positions of new sequences (copied or prefilled)
        self.prefix_reused_tokens = 0  # positions new sequences copied from entries
        self.prefix_evicted_tokens = 0  # positions dropped by EVICT records
        self.prefix_cached_tokens = 0  # positions the entries hold now (an int, like tokens_held)

    def __len__(self) -> int:
        return len(self._positions)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._positions

    # -- prompt chunks --------------------------------------------------------
    def for_chunk(self, seq_id: int, start_pos: int, new_sequence: bool, num_tokens: int,
                  prefix_entry: int = 0, verify: bool = False) -> list[KVCache]:
        """The standalone caches a prompt chunk (or a ``verify``-cation's tokens) starting at ``start_pos``
        extends (a new sequence starting past 0 starts from a copy of prefix entry ``prefix_entry``)."""
        if new_sequence:
            if start_pos != 0 and not prefix_entry:
                raise WireMismatchError(f"sequence {seq_id} starts at position {start_pos}, not 0")
            if seq_id not in self._positions and len(self._positions) >= self._max_sequences:
                raise WireMismatchError(
                    f"stage holds {self._max_sequences} sequences already; the entry stage "
                    f"admitted more than --max-num-seqs"
                )
            self.release(seq_id)
            self._standalone[seq_id] = self._copy_prefix(prefix_entry, start_pos) if start_pos else self._make_caches()
            self._positions[seq_id] = start_pos
            self.tokens_held += start_pos
            self.prefix_queried_tokens += start_pos
        else:
            self._rewind(seq_id, start_pos)
        if new_sequence or (num_tokens > 1 and not verify):  # a prompt chunk (not a decode, nor a verification)
            self.prefix_queried_tokens += num_tokens
        self._check_position(seq_id, start_pos)
        caches = self._standalone.get(seq_id)
        if caches is None:
            caches = self._ungroup(seq_id)
        self._positions[seq_id] += num_tokens
        self.tokens_held += num_tokens
        return caches

    # -- prefix entries ----------------------------------------------------------
    # ``stage_worker.cache.prefix_cache`` decides, on the entry stage only; every stage obeys the same records. A RETAIN
    # record keeps a finishing sequence's first positions as a *prefix entry* instead of freeing them
    # (``retain``); a NEW_SEQUENCE record starting at position K > 0 starts from a copy of its ``prefix_entry``'s
    # first K positions (``_copy_prefix``); an EVICT record drops an entry (``evict``). A sliding window or a
    # recurrent state cannot be cut at a position: such a model's entry is the sequence's whole state at its end
    # (``_retain_whole``), restored whole, at exactly its length.
    def prefix_counts(self) -> PrefixCacheCounts:
        return PrefixCacheCounts(self.prefix_queried_tokens, self.prefix_reused_tokens, self.prefix_cached_tokens,
                                 self.prefix_evicted_tokens)

    def retain(self, seq_id: int, entry_id: int, tokens: int) -> None:
        """Keep the first ``tokens`` positions of ``seq_id`` as prefix entry ``entry_id``
        (the sequence itself is released by its RELEASE flag afterwards)."""
        held = self._positions.get(seq_id)
        if held is None or held < tokens or entry_id in self._prefixes:
            raise WireMismatchError(f"prefix entry {entry_id}: sequence {seq_id} holds {held} positions, "
                                    f"{tokens} to keep (entry known already: {entry_id in self._prefixes})")
        if not self._plain(seq_id):
            self._retain_whole(seq_id, entry_id, tokens, held)
            return
        sources = self._retained_views(seq_id, tokens)
        kept, copies = [], []
        for (keys, values), kind in zip(sources, self._sequence_kinds(seq_id)):
            entry = kind()
            if keys is not None and values is not None:
                # A copy of its own: a view would keep the sequence's (or its group's) whole buffer alive and
                # stop MLX from updating that buffer in place.
                entry.keys, entry.values = kv_map(mx.contiguous, keys), kv_map(mx.contiguous, values)
                entry.offset = tokens
                copies += _arrays(entry)
            kept.append(entry)
        if copies:
            self.evaluate_later(copies)  # every layer's copy in one submission, never waited for here
        self._keep_entry(entry_id, kept, tokens)

    def _keep_entry(self, entry_id: int, caches: list[Any], tokens: int) -> None:
        self._prefixes[entry_id] = caches
        self._prefix_tokens[entry_id] = tokens
        self.prefix_cached_tokens += tokens
        self.tokens_held += tokens

    def _sequence_kinds(self, seq_id: int) -> list[Callable[[], Any]]:
        """Per layer, how to make an empty sequence cache of the kind ``seq_id`` keeps (plain or quantized)."""
        caches = self._standalone.get(seq_id)
        if caches is None:
            caches = self._group_of[seq_id].caches
        return [partial(SequenceQuantizedKVCache, *_quantization(c))
                if hasattr(c, "bits") else KVCache for c in caches]

    def _plain(self, seq_id: int) -> bool:
        """The sequence's every layer keeps plain keys and values (a ``KVCache`` or a quantized one, or a row of
        their batch forms)."""
        caches = self._standalone.get(seq_id)
        if caches is not None:
            return all(isinstance(c, PLAIN_SEQUENCE_CACHES) for c in caches)
        group = self._group_of.get(seq_id)
        return group is None or all(isinstance(c, BatchKVCache) for c in group.caches)

    def _retain_whole(self, seq_id: int, entry_id: int, tokens: int, held: int) -> None:
        """A model with a sliding window or a recurrent state: the entry is the sequence's whole state at its
        end (``tokens`` must be every position it holds), a copy of each layer's cache, found only by a prompt
        that starts with all of it (``PrefixCache(exact=True)``)."""
        if tokens != held:
            raise WireMismatchError(f"prefix entry {entry_id}: sequence {seq_id}'s state is at position {held} and "
                                    f"cannot be kept at {tokens}")
        caches = self._standalone.get(seq_id)
        if caches is None:
            group = self._group_of[seq_id]
            self._settle(group)
            index = group.members.index(seq_id)
            caches = [extract_row(batch, index, held) for batch in group.caches]
        kept = [_copied(cache) for cache in caches]
        self.evaluate_later([a for cache in kept for a in _arrays(cache)])
        self._keep_entry(entry_id, kept, tokens)

    def _retained_views(self, seq_id: int, tokens: int) -> list[tuple[mx.array | None, mx.array | None]]:
        """Per layer, views of the first ``tokens`` positions of ``seq_id``'s keys and values: sliced
        straight out of its decode group's buffer when it is in one (extracting it first would copy
        all its positions once more, for every finishing sequence)."""
        caches = self._standalone.get(seq_id)
        if caches is not None:
            def first(a: mx.array) -> mx.array:
                return a[..., :tokens, :]

            return [(None, None) if c.keys is None or c.values is None
                    else (kv_map(first, c.keys), kv_map(first, c.values)) for c in caches]
        group = self._group_of.get(seq_id)
        if group is None:
            raise WireMismatchError(f"sequence {seq_id} continues but this stage holds no KV for it")
        self._settle(group)
        index, held = group.members.index(seq_id), self._positions[seq_id]
        views: list[tuple[mx.array | None, mx.array | None]] = []
        for batch in group.caches:
            if batch.keys is None or batch.values is None or not tokens:
                views.append((None, None))
                continue
            start = batch._idx - held  # the member's keys are its last ``held`` columns before ``_idx``

            def cut(a: mx.array, start: int = start) -> mx.array:
                return a[index:index + 1, :, start:start + tokens]

            views.append((kv_map(cut, batch.keys), kv_map(cut, batch.values)))
        return views

    def evict(self, entry_id: int) -> None:
        caches = self._prefixes.pop(entry_id, None)
        if caches is None:
            raise WireMismatchError(f"prefix entry {entry_id} evicted but this stage holds no such entry")
        held = self._prefix_tokens.pop(entry_id)
        self.prefix_evicted_tokens += held
        self.prefix_cached_tokens -= held
        self.tokens_held -= held

    def _copy_prefix(self, entry_id: int, tokens: int) -> list[Any]:
        """A new sequence's caches: the first ``tokens`` positions of prefix entry ``entry_id``, as slices (the
        sequence's first chunk writes into a new buffer, so the entry is never written)."""
        entry = self._prefixes.get(entry_id)
        if entry is None or self._prefix_tokens[entry_id] < tokens:
            raise WireMismatchError(f"a new sequence starts from {tokens} positions of prefix entry {entry_id}, "
                                    f"which this stage does not hold")
        if not all(isinstance(c, PLAIN_SEQUENCE_CACHES) for c in entry):
            if tokens != self._prefix_tokens[entry_id]:
                raise WireMismatchError(f"a new sequence starts from {tokens} positions of prefix entry {entry_id}, "
                                        f"a whole state of {self._prefix_tokens[entry_id]} that cannot be cut")
            self.prefix_reused_tokens += tokens
            return [_copied(cache) for cache in entry]  # its own arrays: the sequence's writes leave the entry
        caches = []

        def first(a: mx.array) -> mx.array:
            return a[..., :tokens, :]

        for source in entry:
            cache = (SequenceQuantizedKVCache(source.group_size, source.bits) if hasattr(source, "bits")
                     else KVCache())
            if source.keys is not None and source.values is not None:
                # keys.shape[2] == offset: the first write concatenates into a new buffer (mlx-lm's
                # KVCache.update_and_fetch and QuantizedKVCache's alike), so the entry stays as it is.
                cache.keys, cache.values = kv_map(first, source.keys), kv_map(first, source.values)
                cache.offset = tokens
            caches.append(cache)
        self.prefix_reused_tokens += tokens
        return caches

    # -- decode steps ------------------------------------------------------------
    def for_decode(self, seq_ids: Sequence[int], positions: Sequence[int],
                   lengths: Sequence[int] | None = None) -> list[BatchKVCache]:
        """Per-layer batch caches holding exactly ``seq_ids`` in that order, each ``lengths[i]`` tokens on (one
        each by default). Several tokens are a speculative verification's (``stage_worker.speculation.rules``), beside
        one-token decodes. The step writes ``max(lengths)`` columns for every member: the caller right-pads the
        shorter ones, and the padding becomes the member's pending trim, dropped before the group is next used
        (``_settle``)."""
        lengths = [1] * len(seq_ids) if lengths is None else list(lengths)
        if len(lengths) != len(seq_ids) or min(lengths, default=1) < 1:
            raise WireMismatchError(f"a decode group of {len(seq_ids)} sequences with token counts {lengths}")
        for seq_id, position in zip(seq_ids, positions):
            self._rewind(seq_id, position)
            self._check_position(seq_id, position)
        wanted = list(seq_ids)
        # The group of the first member that is in one (a newcomer may come first after a reorder).
        group = next((self._group_of[m] for m in wanted if m in self._group_of), None)
        if group is not None:
            self._settle(group)
        if group is None or group.members != wanted:
            group = self._regroup(wanted, group)
        width = max(lengths)
        if width > 1:
            self._check_trimmable(group, f"a group step of {width} tokens")
            group.trims = {m: width - n for m, n in zip(wanted, lengths) if n < width}
        for seq_id, n in zip(wanted, lengths):
            self._positions[seq_id] += n
        self.tokens_held += sum(lengths)
        return group.caches

    def _settle(self, group: _Group) -> None:
        """Drop the group's pending trims: afterwards each member's positions are again the last
        ``positions[member]`` columns before the caches' ``_idx``.

        A group settles before anyone reads or changes its columns. The group's end moves back by the smallest
        trim and each other member's row rolls right by the rest, the columns rolled round becoming left padding
        (mlx-lm's ``dynamic_roll``, as ``BatchKVCache.finalize`` settles right padding).
        """
        if not group.trims:
            return
        trims = [group.trims.get(m, 0) for m in group.members]
        group.trims = {}
        common = min(trims)
        shifts = mx.array([t - common for t in trims])
        dropped = mx.array(trims)  # one array for every layer
        rolled = common != max(trims)
        for cache in group.caches:
            cache._idx -= common
            cache.offset = cache.offset - dropped
            if rolled and cache.keys is not None:
                end = cache._idx
                for buffer in kv_arrays(cache):
                    buffer[..., :end, :] = dynamic_roll(buffer[..., :end, :], shifts[:, None], axis=2)
            if rolled:
                cache.left_padding = cache.left_padding + shifts

    @staticmethod
    def _check_trimmable(group: _Group, what: str) -> None:
        for cache in group.caches:
            if not isinstance(cache, BatchKVCache):
                raise WireMismatchError(f"{what} on a decode group holding a {type(cache).__name__}, which cannot "
                                        "drop positions")

    def _regroup(self, wanted: list[int], group: _Group | None) -> _Group:
        """Make ``group`` (the first wanted member's, if any) hold exactly ``wanted``, in that order:
        members not wanted go back to standalone caches (extracted first, then filtered out), newcomers'
        caches are merged in at the end (the same way mlx-lm's ``BatchGenerator`` grows and shrinks its batch),
        and a batch that lists the members in another order costs one gather per layer, not a rebuild."""
        wanted_set = set(wanted)
        kept: list[int] = []
        if group is not None:
            kept = [m for m in group.members if m in wanted_set]
            leaving = [m for m in group.members if m not in wanted_set]
            for member in leaving:
                self._standalone[member] = self._extract(group, member)
                del self._group_of[member]
            if leaving:
                self._filter(group, kept)
        kept_set = set(kept)
        newcomers = [m for m in wanted if m not in kept_set]
        newcomer_caches = []
        for m in newcomers:
            standalone = self._standalone.pop(m, None)
            newcomer_caches.append(standalone or self._ungroup_pop(m))
        if newcomers:
            merged = [newcomer_caches[0][layer].merge([c[layer] for c in newcomer_caches])
                      for layer in range(len(newcomer_caches[0]))]
            if group is None:
                group = _Group(list(newcomers), merged)
            else:
                for cache, extra in zip(group.caches, merged):
                    cache.extend(extra)
                group.members += newcomers
        assert group is not None
        if group.members != wanted:
            self._filter(group, wanted)  # the same members in the batch's order
        for member in group.members:
            self._group_of[member] = group
        return group

    # -- leaving ---------------------------------------------------------------
    def release(self, seq_id: int) -> None:
        self.release_many([seq_id])

    def release_many(self, seq_ids: Sequence[int]) -> None:
        """Free these sequences' KV; each group they leave shrinks once (one ``_filter``)."""
        leaving: dict[int, tuple[_Group, set[int]]] = {}
        for seq_id in seq_ids:
            if self._standalone.pop(seq_id, None) is None and seq_id in self._group_of:
                group = self._group_of.pop(seq_id)
                leaving.setdefault(id(group), (group, set()))[1].add(seq_id)
        for group, gone in leaving.values():
            kept = [m for m in group.members if m not in gone]
            if kept:
                self._filter(group, kept)
            else:
                group.members = []
        for seq_id in seq_ids:
            self.tokens_held -= self._positions.pop(seq_id, 0)

    def _filter(self, group: _Group, kept: list[int]) -> None:
        """Keep ``kept`` (in that order) in ``group``'s caches: ``BatchKVCache.filter`` without its device read.

        mlx-lm's ``BatchKVCache.filter`` reads the left padding back (``tolist``) to trim it, one device sync per
        layer per change, which on a GPU stalls the queued work every time a sequence ends. A member's keys
        occupy the last ``positions[member]`` columns before ``_idx``, so the columns every kept member leaves
        unused at the left are ``_idx - max(positions)``, known on the host. Other cache kinds use mlx-lm's own
        ``filter``.
        """
        self._settle(group)
        indices = mx.array([group.members.index(m) for m in kept])
        longest = max(self._positions[m] for m in kept)
        for cache in group.caches:
            if not isinstance(cache, BatchKVCache):
                cache.filter(indices)  # mlx-lm's own: a window or a recurrent state has no columns to trim here
                continue
            if cache.keys is not None:
                cache.keys = kv_map(lambda a: a[indices], cache.keys)
                cache.values = kv_map(lambda a: a[indices], cache.values)
            cache.offset = cache.offset[indices]
            cache.left_padding = cache.left_padding[indices]
            trim = cache._idx - longest
            if trim > 0:
                if cache.keys is not None:
                    cache.keys = kv_map(lambda a, trim=trim: a[..., trim:, :], cache.keys)
                    cache.values = kv_map(lambda a, trim=trim: a[..., trim:, :], cache.values)
                cache._idx -= trim
                cache.left_padding = cache.left_padding - trim
        group.members = kept

    def _ungroup(self, seq_id: int) -> list[KVCache]:
        caches = self._ungroup_pop(seq_id)
        self._standalone[seq_id] = caches
        return caches

    def _ungroup_pop(self, seq_id: int) -> list[KVCache]:
        group = self._group_of.get(seq_id)
        if group is None:
            raise WireMismatchError(f"sequence {seq_id} continues but this stage holds no KV for it")
        caches = self._extract(group, seq_id)
        self._drop_from_group(seq_id)
        return caches

    def _drop_from_group(self, seq_id: int) -> None:
        group = self._group_of.pop(seq_id)
        kept = [m for m in group.members if m != seq_id]
        if kept:
            self._filter(group, kept)
        else:
            group.members = []

    def _extract(self, group: _Group, seq_id: int) -> list[KVCache]:
        """``BatchKVCache.extract`` without its device read: the member's keys are its last
        ``positions[seq_id]`` columns before ``_idx``."""
        self._settle(group)
        index, held = group.members.index(seq_id), self._positions[seq_id]
        return [extract_row(batch, index, held) for batch in group.caches]

    def _rewind(self, seq_id: int, start_pos: int) -> None:
        """Drop ``seq_id``'s positions from ``start_pos`` on, if it holds more: a rollback.

        A record starting *before* the cache's end (the positions after it held a verification's rejected
        proposals) drops the positions from its ``start_pos`` on: mlx-lm's ``KVCache.trim`` on a standalone
        sequence's caches; for a grouped one, a pending trim (``_settle``), so a grouped sequence never leaves
        its group to roll back. Only a plain ``KVCache`` can drop positions (the same models speculate as get
        prefix entries); a rollback in other caches raises ``WireMismatchError``.
        """
        held = self._positions.get(seq_id)
        if held is None or held <= start_pos or start_pos < 0:
            return  # nothing to drop; ``_check_position`` judges the rest
        caches = self._standalone.get(seq_id)
        group = self._group_of.get(seq_id) if caches is None else None
        if group is not None:
            self._check_trimmable(group, f"sequence {seq_id} continuing at position {start_pos} (held: {held})")
            group.trims[seq_id] = group.trims.get(seq_id, 0) + held - start_pos
        else:
            for cache in caches if caches is not None else self._ungroup(seq_id):
                if not isinstance(cache, PLAIN_SEQUENCE_CACHES) or cache.offset != held:
                    raise WireMismatchError(
                        f"sequence {seq_id} continues at position {start_pos} but this stage's KV holds {held}, "
                        f"in a {type(cache).__name__} that cannot drop positions")
                cache.trim(held - start_pos)
        self._positions[seq_id] = start_pos
        self.tokens_held -= held - start_pos

    def _check_position(self, seq_id: int, start_pos: int) -> None:
        held = self._positions.get(seq_id)
        if held is None:
            raise WireMismatchError(f"sequence {seq_id} continues but this stage holds no KV for it")
        if held != start_pos:
            raise WireMismatchError(
                f"sequence {seq_id} continues at position {start_pos} but this stage's KV "
                f"holds {held} positions"
            )


def _quantization(cache: Any) -> tuple[int, int]:
    """A quantized cache's (group size, bits)."""
    return cache.group_size, cache.bits


def _arrays(cache: Any) -> list[mx.array]:
    out: list[mx.array] = []
    for value in vars(cache).values():
        if isinstance(value, mx.array):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            out += [v for v in value if isinstance(v, mx.array)]
    return out


def _copied(cache: Any) -> Any:
    """``cache`` with arrays of its own (any mlx-lm cache: its arrays are attributes, or a list of them as an
    ``ArraysCache`` keeps): an update of one writes into its own arrays (MLX's slice assignment changes the
    array object it is given), never into the other's."""
    out = copy.copy(cache)
    for name, value in vars(cache).items():
        if isinstance(value, mx.array):
            setattr(out, name, mx.contiguous(value))
        elif isinstance(value, (list, tuple)):
            setattr(out, name, type(value)(mx.contiguous(v) if isinstance(v, mx.array) else v for v in value))
    return out


def _async_eval(arrays: Sequence[mx.array]) -> None:
    mx.async_eval(*arrays)
