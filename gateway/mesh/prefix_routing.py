"""Cache-aware replica choice: send a prompt where its prefix is most likely cached, unless that replica is busy.

Contract:
- ``PrefixIndex(block_size, max_blocks)`` remembers, per replica key, the block hashes
  (``stagemesh_core.prefix_blocks``) of the prompts routed there, least recently used first out past
  ``max_blocks`` per key. ``blocks(tokens)`` names a prompt's whole blocks; ``matched(key, blocks)`` is how
  many of them, from the first, the key was sent; ``record(key, blocks)`` notes that it was sent them;
  ``forget_except(keys)`` drops keys no longer routable (a restarted replica's cache starts empty).
- ``choose_by_prefix(pool, outstanding, matched)`` (pure) is SGLang's cache-aware policy, in requests: the key
  with the longest matched prefix (ties: the least loaded, then the first), unless its outstanding requests
  exceed the least loaded key's by more than ``_SLACK`` and twice over (``loaded_far_past``), or nothing
  matched; None then, and the caller balances by load.

Why what the gateway sent, not what each stage holds: asking would cost a round trip per request, and an
evicted prefix costs one miss, the request then computed exactly as without routing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import TypeVar

from stagemesh_core.prefix_blocks import block_hashes

K = TypeVar("K", bound=Hashable)

# A replica holding a prompt's prefix keeps it while it has at most this many requests more than the least
# loaded one (or at most twice as many): a hit saves the prefix's prefill, but requests sharing a replica share
# its decode steps, so a few sessions that share only a system prompt should not all pile onto one replica.
# SGLang's router balances the same way (an absolute and a relative threshold, both to be passed).
_SLACK = 2


class PrefixIndex:
    def __init__(self, block_size: int, max_blocks: int = 1 << 16) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size = block_size
        self._max = max_blocks
        self._sent: dict[Hashable, OrderedDict[bytes, None]] = {}

    def blocks(self, tokens: Sequence[int]) -> list[bytes]:
        return block_hashes(tokens, self.block_size)

    def matched(self, key: Hashable, blocks: Sequence[bytes]) -> int:
        sent = self._sent.get(key)
        if not sent:
            return 0
        count = 0
        for digest in blocks:  # chained: a block's hash names its whole prefix, so the first miss ends it
            if digest not in sent:
                break
            count += 1
        return count

    def record(self, key: Hashable, blocks: Iterable[bytes]) -> None:
        sent = self._sent.setdefault(key, OrderedDict())
        for digest in blocks:
            sent[digest] = None
            sent.move_to_end(digest)
        while len(sent) > self._max:
            sent.popitem(last=False)

    def forget_except(self, keys: Iterable[Hashable]) -> None:
        keep = set(keys)
        for key in [k for k in self._sent if k not in keep]:
            del self._sent[key]

    def held_blocks(self, key: Hashable) -> int:
        return len(self._sent.get(key, ()))


def loaded_far_past(load: int, least: int) -> bool:
    return load > least + _SLACK and load > 2 * least


def choose_by_prefix(pool: Sequence[K], outstanding: Callable[[K], int], matched: Mapping[K, int]) -> K | None:
    best = max(pool, key=lambda k: (matched.get(k, 0), -outstanding(k)), default=None)
    if best is None or matched.get(best, 0) == 0:
        return None
    least = min(outstanding(k) for k in pool)
    return None if loaded_far_past(outstanding(best), least) else best
