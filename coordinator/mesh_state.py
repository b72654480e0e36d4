"""The mesh as the coordinator sees it: frozen snapshots the gateway and CLI read.

The coordinator produces a new ``MeshSnapshot`` whenever something changes
(placement, health, stats); readers never mutate it. ``to_json`` is the
contract of ``GET /mesh`` and ``stagemesh status --json``:
``{"model", "replicas": [{"replica", "healthy", "stages": [{"rank", "layers":
[start, end], "host", "grpc_port", "ring_port", "pid", "node_id",
"compute_dtype", "quantized", "healthy", ...}]}]}``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class StageStatsSnapshot:
    batches: int = 0
    tokens: int = 0
    compute_seconds: float = 0.0
    wait_seconds: float = 0.0
    send_seconds: float = 0.0
    running_sequences: int = 0
    waiting_requests: int = 0
    requests_finished: int = 0


@dataclass(frozen=True)
class StageSnapshot:
    rank: int
    layers: tuple[int, int]
    host: str
    grpc_port: int
    ring_port: int
    pid: int | None
    node_id: str
    compute_dtype: str
    quantized: bool
    healthy: bool
    state: str = "starting"  # loading, connecting, serving, draining, failed, stopped, starting
    error: str | None = None
    stats: StageStatsSnapshot = field(default_factory=StageStatsSnapshot)
    blas: str = ""  # the BLAS the stage's MLX uses: openblas, mkl, reference, accelerate

    @property
    def grpc_target(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    def to_json(self) -> dict:
        return {
            "rank": self.rank,
            "layers": list(self.layers),
            "host": self.host,
            "grpc_port": self.grpc_port,
            "ring_port": self.ring_port,
            "pid": self.pid,
            "node_id": self.node_id,
            "compute_dtype": self.compute_dtype,
            "quantized": self.quantized,
            "blas": self.blas,
            "healthy": self.healthy,
            "state": self.state,
            "error": self.error,
            "stats": self.stats.__dict__,
        }


@dataclass(frozen=True)
class ReplicaSnapshot:
    replica: int
    stages: tuple[StageSnapshot, ...]
    restarts: int = 0

    @property
    def healthy(self) -> bool:
        return bool(self.stages) and all(s.healthy for s in self.stages)

    @property
    def entry(self) -> StageSnapshot:
        return self.stages[0]

    def to_json(self) -> dict:
        return {
            "replica": self.replica,
            "healthy": self.healthy,
            "restarts": self.restarts,
            "stages": [s.to_json() for s in self.stages],
        }


@dataclass(frozen=True)
class MeshSnapshot:
    model: str
    replicas: tuple[ReplicaSnapshot, ...]

    @property
    def healthy_replicas(self) -> tuple[ReplicaSnapshot, ...]:
        return tuple(r for r in self.replicas if r.healthy)

    def to_json(self) -> dict:
        return {"model": self.model, "replicas": [r.to_json() for r in self.replicas]}


class MeshView(Protocol):
    """What the gateway needs from whoever runs the mesh."""

    def snapshot(self) -> MeshSnapshot: ...
