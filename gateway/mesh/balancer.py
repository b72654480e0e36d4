"""Replica choice: by a client's cache key, by where a prompt's prefix went, else least outstanding requests.

Contract: ``LeastOutstandingBalancer(prefix_index).route(candidates, exclude, cap, affinity, blocks)`` returns
a ``Route`` (the key, the ``policy`` that chose it, the prompt blocks matched there) or ``None`` when no
candidate qualifies (keys in ``exclude`` skipped, keys at ``cap`` skipped when ``cap > 0``); ``pick`` is its
key. The policies, in order:
- ``key``: with an ``affinity`` (a client's cache key, such as the Responses API's ``prompt_cache_key``), the
  qualifying key that ranks first for it by rendezvous hashing, so the same affinity keeps landing on the
  same replica as long as it qualifies, and different affinities spread evenly;
- ``prefix``: with the prompt's ``blocks`` and a ``PrefixIndex``, the key that was sent the longest prefix of
  them, unless it is loaded far past the others (``gateway.mesh.prefix_routing``);
- ``load``: the fewest requests in flight, the starting point rotating on every pick so equally loaded
  replicas take turns.
The chosen key is recorded as holding the prompt's blocks. ``acquire``/``release`` bracket each call. Keys
are any hashable (the gateway's ``(replica, entry target)``: a restarted replica starts from zero).
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

from .prefix_routing import PrefixIndex, choose_by_prefix

K = TypeVar("K", bound=Hashable)
Policy = Literal["key", "prefix", "load"]
POLICIES: tuple[Policy, ...] = ("key", "prefix", "load")


@dataclass(frozen=True)
class Route(Generic[K]):
    key: K
    policy: Policy
    matched_blocks: int = 0  # of the prompt's whole blocks, how many this key was sent before


def _rank(affinity: str, key: Hashable) -> bytes:
    """Rendezvous hashing's weight of ``key`` for ``affinity``: stable across processes and restarts."""
    return hashlib.blake2b(f"{affinity}\0{key!r}".encode(), digest_size=8).digest()


class LeastOutstandingBalancer:
    def __init__(self, prefix_index: PrefixIndex | None = None) -> None:
        self._outstanding: dict[Hashable, int] = {}
        self._turn = 0
        self.prefix_index = prefix_index

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
        route = self.route(candidates, exclude, cap, affinity)
        return None if route is None else route.key

    def route(self, candidates: Sequence[K], exclude: Iterable[Hashable] = (), cap: int = 0,
              affinity: str | None = None, blocks: Sequence[bytes] = ()) -> Route[K] | None:
        pool = self.eligible(candidates, exclude, cap)
        if not pool:
            return None
        index = self.prefix_index
        matched = {k: index.matched(k, blocks) for k in pool} if index is not None and blocks else {}
        route: Route[K]
        if affinity is not None:
            key = max(pool, key=lambda k: _rank(affinity, k))
            route = Route(key, "key", matched.get(key, 0))
        elif (by_prefix := choose_by_prefix(pool, self.outstanding, matched)) is not None:
            route = Route(by_prefix, "prefix", matched[by_prefix])
        else:
            start = self._turn % len(pool)
            self._turn += 1
            rotated = pool[start:] + pool[:start]
            key = min(rotated, key=self.outstanding)  # min keeps the first of equals: the rotation decides ties
            route = Route(key, "load", matched.get(key, 0))
        if index is not None and blocks:
            index.record(route.key, blocks)
        return route

    def acquire(self, key: Hashable) -> None:
        self._outstanding[key] = self.outstanding(key) + 1

    def release(self, key: Hashable) -> None:
        left = self.outstanding(key) - 1
        if left > 0:
            self._outstanding[key] = left
        else:
            self._outstanding.pop(key, None)  # forget replicas that went away
