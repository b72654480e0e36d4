"""A stage's lifecycle state and counters, shared by its runtime and its gRPC service.

The runtime thread writes (state changes, timings); gRPC threads read
snapshots. ``on_state`` lets the service mirror every state change into the
standard gRPC health status.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol

from stage_worker.cache.prefix_cache import PrefixCacheCounts
from stage_worker.checkpoint.load_progress import LoadCounts
from stage_worker.speculation.rules import SpecDecodeCounts
from stagemesh_core.snapshots import StageStats
from stagemesh_core.states import StageState


class HeldTokens(Protocol):
    tokens_held: int  # KVStore's running count; an int read is atomic, so any thread may read it


class StageStatus:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state = StageState.LOADING
        self._error = ""
        self._listeners: list[Callable[[StageState], None]] = []
        self.batches = 0
        self.tokens = 0
        self.compute_seconds = 0.0
        self.wait_seconds = 0.0
        self.send_seconds = 0.0
        self.running_sequences = 0
        self.waiting_requests = 0
        self.requests_finished = 0
        self.generated_tokens = 0
        self.kv_token_capacity = 0
        self._kv: HeldTokens | None = None
        self.weight_bytes = 0
        self.quantized = False
        self.blas = ""
        # Read at GetStageInfo time from the stage's KV store (set once it exists); plain int reads.
        self.prefix_cache: Callable[[], PrefixCacheCounts] | None = None
        self.prefix_block_size = 1
        self.spec_decode: Callable[[], SpecDecodeCounts] | None = None  # the entry stage's scheduler's counts
        self.load = LoadCounts()  # replaced whole by the loading thread (stage_worker.checkpoint.load_progress)

    def on_state(self, listener: Callable[[StageState], None]) -> None:
        with self._lock:
            self._listeners.append(listener)
            state = self._state
        listener(state)

    def set_state(self, state: StageState, error: str = "") -> None:
        with self._lock:
            if self._state == StageState.FAILED and state != StageState.FAILED:
                return  # failure is final for this process
            self._state, self._error = state, error or self._error
            listeners = list(self._listeners)
        for listener in listeners:
            listener(state)

    @property
    def state(self) -> StageState:
        with self._lock:
            return self._state

    @property
    def error(self) -> str:
        with self._lock:
            return self._error

    def record_batch(self, tokens: int, compute_s: float, wait_s: float, send_s: float) -> None:
        with self._lock:
            self.batches += 1
            self.tokens += tokens
            self.compute_seconds += compute_s
            self.wait_seconds += wait_s
            self.send_seconds += send_s

    def record_wait(self, wait_s: float) -> None:
        with self._lock:
            self.wait_seconds += wait_s

    def set_load(self, running: int, waiting: int, finished: int, generated: int = 0) -> None:
        with self._lock:
            self.running_sequences, self.waiting_requests, self.requests_finished = running, waiting, finished
            self.generated_tokens = generated

    def watch_kv(self, kv: HeldTokens, capacity_tokens: int) -> None:
        """Report ``kv.tokens_held`` of ``capacity_tokens`` in every ``stats()`` from now on."""
        with self._lock:
            self._kv, self.kv_token_capacity = kv, capacity_tokens

    def stats(self) -> StageStats:
        counts = self.prefix_cache() if self.prefix_cache is not None else PrefixCacheCounts(0, 0, 0, 0)
        block = max(1, self.prefix_block_size)
        spec = self.spec_decode() if self.spec_decode is not None else SpecDecodeCounts()
        with self._lock:
            return StageStats(self.batches, self.tokens, self.compute_seconds, self.wait_seconds,
                              self.send_seconds, self.running_sequences, self.waiting_requests,
                              self.requests_finished, kv_tokens=self._kv.tokens_held if self._kv else 0,
                              kv_token_capacity=self.kv_token_capacity, generated_tokens=self.generated_tokens,
                              prefix_cache_queries=counts.queried_tokens, prefix_cache_hits=counts.reused_tokens,
                              prefix_cache_blocks=counts.cached_tokens // block,
                              prefix_cache_evictions=counts.evicted_tokens // block,
                              load_done_bytes=self.load.done_bytes, load_total_bytes=self.load.total_bytes,
                              spec_decode_num_drafts=spec.drafts, spec_decode_num_draft_tokens=spec.draft_tokens,
                              spec_decode_num_accepted_tokens=spec.accepted_tokens,
                              spec_decode_num_accepted_tokens_per_pos=spec.accepted_per_position)
