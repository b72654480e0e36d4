"""Per-sequence KV caches of one stage's own layers.

Every stage keeps, for each live sequence, one mlx-lm ``KVCache`` per layer it
owns (never for other stages' layers). The store checks that each chunk
continues its sequence exactly where the cache ends, so a stage that missed a
message fails loudly instead of attending to the wrong positions.
"""

from __future__ import annotations

from collections.abc import Callable

from mlx_lm.models.cache import KVCache

from stage_worker.wire import WireMismatchError


class KVStore:
    def __init__(self, make_caches: Callable[[], list[KVCache]], max_sequences: int) -> None:
        self._make_caches = make_caches
        self._max_sequences = max_sequences
        self._caches: dict[int, list[KVCache]] = {}

    def __len__(self) -> int:
        return len(self._caches)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._caches

    def for_chunk(self, seq_id: int, start_pos: int, new_sequence: bool) -> list[KVCache]:
        """The caches a chunk starting at ``start_pos`` must extend."""
        if new_sequence:
            if start_pos != 0:
                raise WireMismatchError(f"sequence {seq_id} starts at position {start_pos}, not 0")
            if seq_id not in self._caches and len(self._caches) >= self._max_sequences:
                raise WireMismatchError(
                    f"stage holds {self._max_sequences} sequences already; the entry stage "
                    f"admitted more than --max-num-seqs"
                )
            self._caches[seq_id] = self._make_caches()
        caches = self._caches.get(seq_id)
        if caches is None:
            raise WireMismatchError(f"sequence {seq_id} continues but this stage holds no KV for it")
        held = caches[0].offset if caches else start_pos
        if held != start_pos:
            raise WireMismatchError(
                f"sequence {seq_id} continues at position {start_pos} but this stage's KV "
                f"holds {held} positions"
            )
        return caches

    def release(self, seq_id: int) -> None:
        self._caches.pop(seq_id, None)
