"""Replica choice: least outstanding requests, ties broken round-robin.

Contract: ``LeastOutstandingBalancer.pick(candidates, exclude, cap)`` returns
the candidate key with the fewest requests in flight (keys in ``exclude``
skipped, keys at ``cap`` skipped when ``cap > 0``), rotating the starting
point on every pick so equally loaded replicas take turns; ``None`` when no
candidate qualifies. With an ``affinity`` (a client's cache key, such as the
Responses API's ``prompt_cache_key``) the pick is instead the qualifying key
that ranks first for it by rendezvous hashing: the same affinity keeps
landing on the same replica (whose prefix cache holds its conversation) for
as long as that replica qualifies, and different affinities spread evenly.
``acquire``/``release`` bracket each call. Keys are any hashable (the gateway
uses ``(replica, entry target)`` so a replica restarted on a new port starts
from zero). Pure and single-threaded (the event loop).
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Iterable, Sequence
from typing import TypeVar

K = TypeVar("K", bound=Hashable)


def _rank(affinity: str, key: Hashable) -> bytes:
    """Rendezvous hashing's weight of ``key`` for ``affinity``: stable across processes and restarts."""
    return hashlib.blake2b(f"{affinity}\0{key!r}".encode(), digest_size=8).digest()


class LeastOutstandingBalancer:
    def __init__(self) -> None:
        self._outstanding: dict[Hashable, int] = {}
        self._turn = 0

    def outstanding(self, key: Hashable) -> int:
        return self._outstanding.get(key, 0)

    def snapshot(self) -> dict[Hashable, int]:
        return dict(self._outstanding)

    def eligible(self, candidates: Sequence[K], exclude: Iterable[Hashable] = (), cap: int = 0) -> list[K]:
        """Candidates not excluded and under ``cap`` (no side effect)."""
        excluded = set(exclude)
        return [k for k in candidates if k not in excluded and (cap <= 0 or self.outstanding(k) < cap)]

    def pick(self, candidates: Sequence[K], exclude: Iterable[Hashable] = (), cap: int = 0,
             affinity: str | None = None) -> K | None:
        pool = self.eligible(candidates, exclude, cap)
        if not pool:
            return None
        if affinity is not None:
            return max(pool, key=lambda k: _rank(affinity, k))
        start = self._turn % len(pool)
        self._turn += 1
        rotated = pool[start:] + pool[:start]
        return min(rotated, key=self.outstanding)  # min keeps the first of equals: the rotation decides ties

    def acquire(self, key: Hashable) -> None:
        self._outstanding[key] = self.outstanding(key) + 1

    def release(self, key: Hashable) -> None:
        left = self.outstanding(key) - 1
        if left > 0:
            self._outstanding[key] = left
        else:
            self._outstanding.pop(key, None)  # forget replicas that went away
