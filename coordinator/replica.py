"""The coordinator's live records of a replica and its stages: mutable, written under the coordinator's lock.

- ``LiveStage``: one stage's StageHost actor, placement, gRPC channel, process
  and what its last health check said.
- ``LiveReplica``: its placement group, stages, pipeline plan and its
  supervision record (``coordinator.supervision.ReplicaRecord``, replaced
  whole on each transition).
- ``ReplicaFailed``: a stage of a replica failed while it was starting; the
  message names the stage and carries its log tail.
- ``Stopping``: ``MeshCoordinator.stop()`` was called while a replica was
  being started or waited on; the caller unwinds quietly.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from coordinator.health import StageChannel
from coordinator.placement import StageSlot
from coordinator.stage_host import HostInfo
from coordinator.supervision import ReplicaRecord
from stagemesh_core.plan import PipelinePlan, StagePlacement
from stagemesh_core.snapshots import StageStats
from stagemesh_core.states import StageState


@dataclass
class LiveStage:
    replica: int
    slot: StageSlot
    actor: Any
    placement: StagePlacement | None = None
    channel: StageChannel | None = None
    host: HostInfo | None = None
    pid: int | None = None
    state: StageState = StageState.STARTING
    exit_code: int | None = None  # the process's, once it exited
    healthy: bool = False
    error: str | None = None
    compute_dtype: str = ""
    quantized: bool = False
    blas: str = ""
    backend: str = ""  # MLX's backend the stage reports: cpu, metal, cuda
    device: str = ""  # the device's name it reports
    gpu_index: int | None = None  # the GPU of its node it was given (placement.assign_gpus)
    stats: StageStats = field(default_factory=StageStats)
    misses: int = 0
    started_at: float = 0.0
    load_tenths_logged: int = 0  # tenths of its weights' loading already logged (coordinator.checks)

    @property
    def rank(self) -> int:
        return self.slot.rank

    @property
    def member(self) -> int:
        """Its place in the stage's tensor-parallel group (0: the stage's worker 0)."""
        return self.slot.member

    @property
    def name(self) -> str:
        p = self.placement
        grouped = p is not None and p.group_port
        where = f" ({p.host} grpc :{p.grpc_port} {'group' if grouped else 'ring'} :" \
                f"{p.group_port if grouped else p.ring_port})" if p else ""
        worker = f" worker {self.member}" if grouped else ""
        return f"replica {self.replica} stage {self.rank}{worker}{where}"


@dataclass
class LiveReplica:
    index: int
    group: Any
    stages: list[LiveStage]
    record: ReplicaRecord
    plan: PipelinePlan | None = None
    thread: threading.Thread | None = None

    def host_addresses(self) -> list[str]:
        """The address each stage's worker advertises, in ``PipelinePlan.workers`` order; ``ReplicaHosts.describe``
        has filled them in."""
        hosts = []
        for s in self.stages:
            assert s.host is not None, f"{s.name}: host not described yet"
            hosts.append(s.host.host)
        return hosts


class ReplicaFailed(RuntimeError):
    def __init__(self, stage: LiveStage, reason: str, log_tail: str) -> None:
        super().__init__(f"{stage.name} failed: {reason}" + (f"\n--- its log:\n{log_tail}" if log_tail else ""))
        self.stage = stage
        self.reason = reason


class Stopping(Exception):
    """stop() was called while a replica was starting; unwind quietly."""
