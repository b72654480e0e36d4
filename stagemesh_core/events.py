"""What happened to the mesh, with times: a bounded journal the coordinator owns.

Contract:
- ``MeshEvent`` is one frozen entry: ``seq`` (1, 2, 3 … in the order recorded,
  so a reader can tell new entries from ones it has shown), ``time`` (Unix
  seconds, wall clock, for people), ``kind`` (one of ``EVENT_KINDS``),
  ``replica`` / ``rank`` (None when the event is about no single one) and a
  one-line ``message``.
- ``EventJournal.record(...)`` appends (any thread); ``recent()`` returns the
  last ``capacity`` entries oldest first. Older entries are dropped, never the
  newest: the journal is for watching the mesh live, logs keep the history.
- The coordinator puts ``recent()`` into every ``MeshSnapshot`` it publishes,
  so the events travel with the snapshot (``GET /mesh``, the dashboard) and
  have no second home.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# kind -> what it means (docs/api.md lists the same)
EVENT_KINDS: dict[str, str] = {
    "mesh_serving": "every replica serves after `stagemesh serve` started",
    "stage_lost": "a stage failed: its process exited, its host actor vanished or it stopped answering",
    "replica_restarting": "a replica is being stopped whole and started again",
    "replica_replaced": "a replica was placed again on other nodes (its hosts were gone)",
    "replica_serving": "a restarted replica serves again",
    "replica_backing_off": "a replica died again soon after a restart; the next restart waits (capped backoff)",
    "replica_failed": "the coordinator gave up a replica that never served (a model or setting that cannot load)",
    "node_lost": "a node's StageHost stopped answering; placement avoids the node for a while",
    "mesh_stopped": "the mesh was stopped",
}


@dataclass(frozen=True)
class MeshEvent:
    seq: int
    time: float
    kind: str
    message: str
    replica: int | None = None
    rank: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"seq": self.seq, "time": self.time, "kind": self.kind, "replica": self.replica,
                "rank": self.rank, "message": self.message}


class EventJournal:
    def __init__(self, capacity: int = 200, wall_clock: Callable[[], float] = time.time) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self._events: deque[MeshEvent] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        self._clock = wall_clock
        self._seq = 0

    def record(self, kind: str, message: str, *, replica: int | None = None, rank: int | None = None) -> MeshEvent:
        if kind not in EVENT_KINDS:
            raise ValueError(f"unknown event kind {kind!r}; add it to EVENT_KINDS with its meaning")
        with self._lock:
            self._seq += 1
            event = MeshEvent(self._seq, self._clock(), kind, message, replica, rank)
            self._events.append(event)
        return event

    def recent(self) -> tuple[MeshEvent, ...]:
        with self._lock:
            return tuple(self._events)
