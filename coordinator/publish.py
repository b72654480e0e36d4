"""What the coordinator shows: the immutable ``MeshSnapshot`` and the event journal behind it.

- ``replica_snapshot(replica, now, wall_offset, policy, compute_dtype)`` is the
  pure view of one live replica: its stages, restarts and supervision
  (``ReplicaState``, failures in a row, the pending backoff). Monotonic times
  become Unix times by ``wall_offset``.
- ``Publisher`` owns the ``EventJournal`` and the current snapshot:
  ``record(...)`` journals an event, ``publish(replicas)`` rebuilds the
  snapshot (the caller holds the coordinator's lock, so the replicas do not
  change underneath), ``snapshot()`` returns the latest (any thread). The
  snapshot is what ``GET /mesh``, ``stagemesh status`` and the dashboard read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from coordinator.replica import LiveReplica
from coordinator.supervision import BackoffPolicy, failures_in_a_row, pending_restart, replica_state
from stagemesh_core.events import EventJournal
from stagemesh_core.snapshots import MeshSnapshot, ReplicaSnapshot, StageSnapshot


def replica_snapshot(replica: LiveReplica, now: float, wall_offset: float, policy: BackoffPolicy,
                     compute_dtype: str) -> ReplicaSnapshot:
    stages = []
    for s in replica.stages:
        p = s.placement
        stages.append(StageSnapshot(
            rank=s.rank,
            layers=(p.layers.start, p.layers.end) if p else (0, 0),
            host=p.host if p else s.slot.address,
            grpc_port=p.grpc_port if p else 0,
            ring_port=p.ring_port if p else 0,
            pid=s.pid, node_id=s.slot.node_id, compute_dtype=s.compute_dtype or compute_dtype,
            quantized=s.quantized, healthy=s.healthy, state=s.state, error=s.error, stats=s.stats,
            blas=s.blas, backend=s.backend, device=s.device,
            started_at=s.started_at + wall_offset if s.started_at and s.pid else None, member=s.member,
        ))
    record = replica.record
    pending = pending_restart(record, now, policy)
    return ReplicaSnapshot(
        replica.index, tuple(stages), record.restarts, state=replica_state(record, now, policy),
        consecutive_failures=failures_in_a_row(record, now, policy),
        backoff_s=pending[0] if pending else None,
        next_restart_at=pending[1] + wall_offset if pending else None)


class Publisher:
    def __init__(self, model: str, compute_dtype: str, policy: BackoffPolicy, clock: Callable[[], float],
                 wall_clock: Callable[[], float]) -> None:
        self._model = model
        self._compute_dtype = compute_dtype
        self._policy = policy
        self._clock = clock
        self._wall_clock = wall_clock
        self._events = EventJournal(wall_clock=wall_clock)
        self._snapshot = MeshSnapshot(model, ())

    def snapshot(self) -> MeshSnapshot:
        return self._snapshot  # replaced whole, never changed: reading the reference needs no lock

    def record(self, kind: str, message: str, *, replica: int | None = None, rank: int | None = None) -> None:
        self._events.record(kind, message, replica=replica, rank=rank)

    def publish(self, replicas: Sequence[LiveReplica]) -> None:
        now = self._clock()
        wall_offset = self._wall_clock() - now  # the records keep monotonic times; the snapshot gives Unix times
        self._snapshot = MeshSnapshot(
            self._model,
            tuple(replica_snapshot(r, now, wall_offset, self._policy, self._compute_dtype) for r in replicas),
            self._events.recent())
