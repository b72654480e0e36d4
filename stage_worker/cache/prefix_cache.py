"""Which token prefixes the pipeline keeps KV for: the entry stage's prefix-cache bookkeeping. Pure logic, no MLX.

``PrefixCache`` names block i of a token sequence (``block_size`` tokens each) by a chained hash of every token
up to its end and of a salt naming the model and compute dtype (``block_hashes``), so equal hashes mean equal
prefixes; only whole blocks are ever cached or reused. A finished sequence's whole blocks are kept on every
stage as one *entry* (``insert``), named by a small integer id that travels on the wire
(``SequenceRecord.prefix_entry``). ``lookup`` (at admission only, never per decode step) finds the longest
cached prefix of a prompt and takes a reference on its entry; a referenced entry is never evicted. Entries live
in the stage's KV budget next to the running sequences' reservations: ``evict_to`` keeps them within what
admission leaves free, so a cached block never takes a place a running sequence needs.

With ``exact=True`` (a sliding-window or recurrent layer: no cut at a block) an entry is a whole state, of a
finished sequence (``insert``) or of a prompt but its last token (``insert_checkpoint``), found only by a prompt
starting with all its tokens. The entry stage alone decides; the others obey the records (``kv_store``).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from stagemesh_core.prefix_blocks import block_hashes

__all__ = ["PrefixCache", "PrefixHit", "block_hashes"]

_MAX_ENTRY_ID = 2**32 - 1  # entry ids travel in a uint32 record field; 0 means "no entry"


@dataclass(frozen=True)
class PrefixCacheCounts:
    """What a stage's KV store did with cached prefixes, in tokens (``KVStore``'s counters, shown in status)."""

    queried_tokens: int
    reused_tokens: int
    cached_tokens: int
    evicted_tokens: int


@dataclass(frozen=True)
class PrefixHit:
    """A new sequence starts from the first ``tokens`` positions of entry ``entry_id``."""

    entry_id: int
    tokens: int


@dataclass(frozen=True)
class Retain:
    """What ``insert`` decided: keep ``tokens`` positions as entry ``entry_id`` (None: keep nothing),
    and drop the entries it supersedes."""

    entry_id: int | None
    tokens: int
    superseded: tuple[int, ...] = ()


@dataclass
class _Entry:
    hashes: list[bytes]  # the keys it is found by: its blocks' chain, or its one exact key
    tokens: int  # positions it holds
    references: int = 0
    checkpoint: bool = False  # exact mode: a prompt's state before its last token (``insert_checkpoint``)


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up (vLLM's prefix_cache_queries)
    hits: int = 0  # prompt tokens found cached (vLLM's prefix_cache_hits)
    evicted_blocks: int = 0  # blocks dropped: least recently used for room, or superseded by a longer entry


@dataclass
class PrefixCache:
    block_size: int
    salt: bytes = b""
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    exact: bool = False  # entries are whole sequences' end states, found only at their full length

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"prefix cache block size must be at least 1, got {self.block_size}")
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._by_hash: dict[bytes, set[int]] = {}
        self._lengths: dict[int, int] = {}  # exact mode: entry length -> entries of that length
        self._next_id = 1
        # Kept up to date so the scheduler's admission check (run every engine loop) stays O(1).
        self._cached_tokens = 0
        self._pinned_tokens = 0

    # -- what is held -----------------------------------------------------
    @property
    def cached_blocks(self) -> int:
        return self._cached_tokens // self.block_size

    @property
    def cached_tokens(self) -> int:
        return self._cached_tokens

    @property
    def pinned_tokens(self) -> int:
        """Tokens held by referenced entries: these cannot be evicted now."""
        return self._pinned_tokens

    def _exact_key(self, tokens: Sequence[int]) -> bytes:
        digest = hashlib.blake2b(self.salt + b"\0exact", digest_size=16)
        digest.update(b"".join(int(t).to_bytes(4, "little", signed=True) for t in tokens))
        return digest.digest()

    def __contains__(self, entry_id: int) -> bool:
        return entry_id in self._entries

    def references(self, entry_id: int) -> int:
        return self._entries[entry_id].references

    # -- admission ----------------------------------------------------------
    def lookup(self, prompt: Sequence[int]) -> PrefixHit | None:
        """The longest cached prefix of ``prompt`` that leaves a token to prefill; takes a reference on it.

        At least one prompt token is left to prefill: the last stage needs a row to sample the first token
        from. The new sequence starts from a copy of the entry's first ``tokens`` positions and holds the
        reference until its first prompt chunk has been sent (the copy happens there, on every stage)."""
        self.stats.queries += len(prompt)
        if self.exact:
            return self._lookup_exact(prompt)
        usable = (len(prompt) - 1) // self.block_size
        holders: set[int] = set()
        matched = 0
        for digest in block_hashes(prompt, self.block_size, self.salt, usable):
            found = self._by_hash.get(digest)
            if not found:
                break
            holders, matched = found, matched + 1
        if not matched:
            return None
        best = self._most_recent(holders)
        self._entries.move_to_end(best)
        self._reference(self._entries[best], +1)
        self.stats.hits += matched * self.block_size
        return PrefixHit(best, matched * self.block_size)

    def _lookup_exact(self, prompt: Sequence[int]) -> PrefixHit | None:
        """The longest entry all of whose tokens begin ``prompt`` and leave a token to prefill."""
        for length in sorted((n for n in self._lengths if n < len(prompt)), reverse=True):
            found = self._by_hash.get(self._exact_key(prompt[:length]))
            if found:
                best = self._most_recent(found)
                self._entries.move_to_end(best)
                self._reference(self._entries[best], +1)
                self.stats.hits += length
                return PrefixHit(best, length)
        return None

    def release(self, entry_id: int) -> None:
        """Drop the reference a lookup took (the sequence's copy has been sent)."""
        entry = self._entries[entry_id]
        if entry.references < 1:
            raise ValueError(f"prefix entry {entry_id} released more often than it was looked up")
        self._reference(entry, -1)

    def cancel(self, hit: PrefixHit) -> None:
        """Undo a lookup whose hit the caller cannot use (the entry would not fit beside the new sequence)."""
        self.release(hit.entry_id)
        self.stats.hits -= hit.tokens

    def evict_to(self, max_tokens: int) -> list[int]:
        """Drop least recently used unreferenced entries until at most ``max_tokens`` are cached."""
        evicted = []
        cached = self.cached_tokens
        for entry_id in list(self._entries):
            if cached <= max_tokens:
                break
            entry = self._entries[entry_id]
            if entry.references:
                continue
            cached -= entry.tokens
            self.stats.evicted_blocks += self._blocks(entry)
            self._remove(entry_id)
            evicted.append(entry_id)
        return evicted

    # -- a sequence finished ----------------------------------------------
    def insert(self, tokens: Sequence[int], kv_tokens: int) -> Retain:
        """A finished sequence whose stages hold KV for its first ``kv_tokens`` of ``tokens`` (prompt and
        generated tokens the stages fed). An entry whose blocks are all the first blocks of the new one is
        dropped in its favour (the newer one answers every lookup the older could), and a sequence whose blocks
        an entry already covers adds nothing. In exact mode the entry is all ``kv_tokens`` positions (the
        state the stages hold at its end), and it supersedes the entries it begins with."""
        if self.exact:
            return self._insert_exact(tokens[:kv_tokens], checkpoint=False)
        hashes = block_hashes(tokens[:kv_tokens], self.block_size, self.salt)
        if not hashes:
            return Retain(None, 0)
        holders = self._by_hash.get(hashes[-1])
        if holders:  # an entry already holds all these blocks: it was just used
            self._entries.move_to_end(self._most_recent(holders))
            return Retain(None, 0)
        entry_id = self._new_id()
        superseded = tuple(
            other for other, entry in list(self._entries.items())
            if not entry.references and len(entry.hashes) < len(hashes)
            and entry.hashes[-1] == hashes[len(entry.hashes) - 1]
        )
        for other in superseded:
            self.stats.evicted_blocks += self._blocks(self._entries[other])
            self._remove(other)
        self._add(entry_id, _Entry(hashes, len(hashes) * self.block_size))
        return Retain(entry_id, len(hashes) * self.block_size, superseded)

    def insert_checkpoint(self, tokens: Sequence[int]) -> Retain:
        """Exact mode: a running sequence's state after ``tokens`` (its prompt but the last token), kept while
        it goes on. A finished sequence's entry (``insert``) begins with it but does not supersede it: the
        checkpoint is what a regenerated turn restores, which the finished state (past the prompt) cannot be
        cut back to. A checkpoint supersedes the entries of both kinds it begins with (a later turn's prompt
        holds the earlier turns whole), so a conversation keeps about two entries: its last prompt's checkpoint
        and its last finished state."""
        if not self.exact:
            raise ValueError("prompt checkpoints are for exact-mode caches: a plain one cuts any entry at a block")
        return self._insert_exact(tokens, checkpoint=True)

    def _insert_exact(self, kept: Sequence[int], *, checkpoint: bool) -> Retain:
        if not kept:
            return Retain(None, 0)
        key = self._exact_key(kept)
        holders = self._by_hash.get(key)
        if holders:
            self._entries.move_to_end(self._most_recent(holders))
            return Retain(None, 0)
        entry_id = self._new_id()
        superseded = tuple(
            other for other, entry in list(self._entries.items())
            if not entry.references and entry.tokens < len(kept) and (checkpoint or not entry.checkpoint)
            and entry.hashes[0] == self._exact_key(kept[:entry.tokens]))
        for other in superseded:
            self.stats.evicted_blocks += self._blocks(self._entries[other])
            self._remove(other)
        self._add(entry_id, _Entry([key], len(kept), checkpoint=checkpoint))
        return Retain(entry_id, len(kept), superseded)

    def clear(self) -> None:
        self._entries.clear()
        self._by_hash.clear()
        self._lengths.clear()
        self._cached_tokens = self._pinned_tokens = 0

    # -- helpers ------------------------------------------------------------
    def _most_recent(self, holders: set[int]) -> int:
        # Runs at admission and retirement only; entries are few (one per distinct finished prefix).
        return next(key for key in reversed(self._entries) if key in holders)

    def _blocks(self, entry: _Entry) -> int:
        return -(-entry.tokens // self.block_size)  # an exact entry's partial last block counts as one

    def _reference(self, entry: _Entry, change: int) -> None:
        if entry.references == 0 or entry.references + change == 0:
            self._pinned_tokens += entry.tokens * change
        entry.references += change

    def _add(self, entry_id: int, entry: _Entry) -> None:
        self._entries[entry_id] = entry
        self._cached_tokens += entry.tokens
        for digest in entry.hashes:
            self._by_hash.setdefault(digest, set()).add(entry_id)
        if self.exact:
            self._lengths[entry.tokens] = self._lengths.get(entry.tokens, 0) + 1

    def _remove(self, entry_id: int) -> None:
        entry = self._entries.pop(entry_id)
        self._cached_tokens -= entry.tokens
        if self.exact:
            left = self._lengths[entry.tokens] - 1
            if left:
                self._lengths[entry.tokens] = left
            else:
                del self._lengths[entry.tokens]
        for digest in entry.hashes:
            holders = self._by_hash.get(digest)
            if holders is not None:
                holders.discard(entry_id)
                if not holders:
                    del self._by_hash[digest]

    def _new_id(self) -> int:
        while True:
            entry_id = self._next_id
            self._next_id = 1 if self._next_id >= _MAX_ENTRY_ID else self._next_id + 1
            if entry_id not in self._entries:
                return entry_id
