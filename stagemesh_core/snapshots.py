"""The mesh as the coordinator sees it, and a stage's counters: frozen snapshots everyone reads.

``StageStats`` is the one shape of a stage's counters: the stage fills it, it travels as
``stagemesh.v1.StageStats`` (``to_proto`` / ``from_proto``), the coordinator keeps it in the snapshot and the
benchmark's profile reads it back from ``/metrics``.

The coordinator produces a new ``MeshSnapshot`` (of ``ReplicaSnapshot`` and ``StageSnapshot``) whenever
something changes (placement, health, stats); readers never mutate it. ``MeshSnapshot.to_json`` is the
contract of ``GET /mesh`` and ``stagemesh status --json``. ``MeshView`` is what the gateway needs from
whoever runs the mesh.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Protocol

from stagemesh_core.events import MeshEvent
from stagemesh_core.states import ReplicaState, StageState
from stagemesh_core.v1 import stage_pb2


@dataclass(frozen=True)
class StageStats:
    """A stage's counters since it started (``stagemesh.v1.StageStats``)."""

    batches: int = 0  # batches this stage computed
    tokens: int = 0  # token rows it computed
    compute_seconds: float = 0.0  # in its own layers (and head, sampling)
    wait_seconds: float = 0.0  # waiting for input from its predecessor
    send_seconds: float = 0.0  # handing results to its successor
    running_sequences: int = 0  # sequences holding KV on this stage
    waiting_requests: int = 0  # entry stage: queued, not yet running
    requests_finished: int = 0  # entry stage
    kv_tokens: int = 0  # token positions of KV this stage holds now
    kv_token_capacity: int = 0  # token positions its memory budget allows (0: not known yet)
    generated_tokens: int = 0  # entry stage: tokens sampled for requests (the replica's output)
    prefix_cache_queries: int = 0  # prompt tokens of new sequences, in tokens as vLLM counts them
    prefix_cache_hits: int = 0  # of those, positions copied from a cached prefix
    prefix_cache_blocks: int = 0  # blocks cached now
    prefix_cache_evictions: int = 0  # blocks dropped (least recently used for room, or superseded)
    load_done_bytes: int = 0  # bytes of model files read (or converted) so far
    load_total_bytes: int = 0  # of the total it reads (0: not loading yet, or nothing to read)
    # Entry stage, speculative decoding (vLLM's spec_decode_* counters): verifications, tokens proposed, of those
    # accepted, and per proposal position the verifications that accepted it.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()

    def to_proto(self) -> stage_pb2.StageStats:
        return stage_pb2.StageStats(**asdict(self))

    @classmethod
    def from_proto(cls, message: stage_pb2.StageStats) -> StageStats:
        values = {f.name: getattr(message, f.name) for f in fields(cls)}
        values["spec_decode_num_accepted_tokens_per_pos"] = tuple(values["spec_decode_num_accepted_tokens_per_pos"])
        return cls(**values)

    def to_json(self) -> dict[str, Any]:
        per_position = list(self.spec_decode_num_accepted_tokens_per_pos)  # JSON's own shape: a list
        return {**asdict(self), "spec_decode_num_accepted_tokens_per_pos": per_position}


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
    state: StageState = StageState.STARTING
    error: str | None = None
    stats: StageStats = field(default_factory=StageStats)
    blas: str = ""  # the BLAS the stage's MLX uses: openblas, mkl, reference, accelerate
    backend: str = ""  # MLX's backend: cpu, metal, cuda ("" until the stage says)
    device: str = ""  # the device's name: "NVIDIA H200", "Apple M2 Max (applegpu_g14s)", the CPU's model
    started_at: float | None = None  # Unix time its current process was started (None: not started)
    member: int = 0  # its place in the stage's tensor-parallel group (0: the stage's worker 0, the one it talks to)

    @property
    def grpc_target(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "member": self.member,
            "layers": list(self.layers),
            "host": self.host,
            "grpc_port": self.grpc_port,
            "ring_port": self.ring_port,
            "pid": self.pid,
            "node_id": self.node_id,
            "compute_dtype": self.compute_dtype,
            "quantized": self.quantized,
            "blas": self.blas,
            "backend": self.backend,
            "device": self.device,
            "healthy": self.healthy,
            "state": self.state.value,
            "error": self.error,
            "started_at": self.started_at,
            "stats": self.stats.to_json(),
        }


@dataclass(frozen=True)
class ReplicaSnapshot:
    replica: int
    stages: tuple[StageSnapshot, ...]
    restarts: int = 0  # restarts begun since the mesh started
    state: ReplicaState = ReplicaState.SERVING  # the coordinator always sets it; the default suits a fixed mesh
    consecutive_failures: int = 0  # failures since it last served a while in one go (0: none)
    backoff_s: float | None = None  # while backing off: how long it waits before the pending restart
    next_restart_at: float | None = None  # while backing off: when that restart is due (Unix seconds)

    @property
    def healthy(self) -> bool:
        return bool(self.stages) and all(s.healthy for s in self.stages)

    @property
    def suspect(self) -> bool:
        """Serving, but a stage missed its latest health checks (fewer than fail it): one slow answer on a
        loaded machine, or a stage about to be failed."""
        return (bool(self.stages) and not self.healthy and self.state is ReplicaState.SERVING
                and all(s.state is StageState.SERVING for s in self.stages))

    @property
    def entry(self) -> StageSnapshot:
        return self.stages[0]

    def to_json(self) -> dict[str, Any]:
        return {
            "replica": self.replica,
            "healthy": self.healthy,
            "restarts": self.restarts,
            "state": self.state.value,
            "consecutive_failures": self.consecutive_failures,
            "backoff_s": self.backoff_s,
            "next_restart_at": self.next_restart_at,
            "stages": [s.to_json() for s in self.stages],
        }


@dataclass(frozen=True)
class MeshSnapshot:
    model: str
    replicas: tuple[ReplicaSnapshot, ...]
    events: tuple[MeshEvent, ...] = ()  # the coordinator's recent events, oldest first

    @property
    def healthy_replicas(self) -> tuple[ReplicaSnapshot, ...]:
        return tuple(r for r in self.replicas if r.healthy)

    @property
    def routable_replicas(self) -> tuple[ReplicaSnapshot, ...]:
        """Where requests go (pure): the healthy replicas; when there are none, the suspect ones. A replica whose
        stage missed a health check or two is still serving until the coordinator fails it, and refusing
        every request meanwhile (a lone replica on a loaded machine) would turn one slow answer into errors;
        if the stage is really gone, the request fails fast on its own and fails over as any other does."""
        return self.healthy_replicas or tuple(r for r in self.replicas if r.suspect)

    def to_json(self) -> dict[str, Any]:
        """The contract of ``GET /mesh`` and ``stagemesh status --json``.

        ``{"model", "replicas": [{"replica", "healthy", "restarts", "state", "consecutive_failures",
        "backoff_s", "next_restart_at", "stages": [{"rank", "layers": [start, end], "host", "grpc_port",
        "ring_port", "pid", "node_id", "compute_dtype", "quantized", "blas", "backend", "device", "healthy", ...,
        "stats": {..., "kv_tokens", "kv_token_capacity"}}]}], "events": [...]}``: each stage's KV in tokens
        (what its sequences hold now and what its budget allows); a replica's ``state`` is a ``ReplicaState``,
        ``consecutive_failures`` its failures since it last served a while in one go, ``backoff_s`` /
        ``next_restart_at`` (Unix seconds) the wait before its pending restart while it backs off, else null;
        ``events``: the coordinator's recent ``MeshEvent``s, oldest first.
        """
        return {"model": self.model, "replicas": [r.to_json() for r in self.replicas],
                "events": [e.to_json() for e in self.events]}


class MeshView(Protocol):
    """What the gateway needs from whoever runs the mesh."""

    def snapshot(self) -> MeshSnapshot: ...
