"""Stage health: how the coordinator probes a stage and judges the answer.

- ``StageChannel`` holds one gRPC channel to a stage and issues, without blocking, the two probes the
  coordinator needs: the standard ``grpc.health.v1.Health/Check`` (service "") and
  ``stagemesh.v1.Stage/GetStageInfo``; ``finish_probe`` collects them.
- ``judge(probe, ...)`` is the pure rule turning one ``StageProbe`` into a ``Verdict`` and a reason: a stage
  whose process exited, whose host is gone or that reports FAILED fails at once; a serving stage that stops
  answering fails only after ``max_misses`` checks in a row.
- ``info_view`` keeps the parts of ``stagemesh.v1.StageInfo`` the snapshot shows.

What follows a failure (restart, backoff) is ``coordinator.supervision``'s.
"""

from __future__ import annotations

import enum
from concurrent.futures import Future
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stagemesh_core.grpc_tls import TlsFiles, open_channel
from stagemesh_core.mesh_token import call_metadata
from stagemesh_core.snapshots import StageStats
from stagemesh_core.states import StageState, UnknownStateError, describe_exit, state_from_proto
from stagemesh_core.v1 import stage_pb2, stage_pb2_grpc


class Verdict(enum.Enum):
    SERVING = "serving"
    STARTING = "starting"
    DRAINING = "draining"
    SUSPECT = "suspect"  # not serving now; fails after max_misses in a row
    FAILED = "failed"


@dataclass(frozen=True)
class StageInfoView:
    """The parts of ``stagemesh.v1.StageInfo`` the snapshot keeps."""

    state: StageState
    pid: int
    compute_dtype: str
    quantized: bool
    error: str
    blas: str
    weight_bytes: int
    stats: StageStats
    backend: str = ""  # MLX's backend: cpu, metal, cuda ("" from a stage that does not say)
    device: str = ""  # the device's name


@dataclass(frozen=True)
class StageProbe:
    exit_code: int | None = None  # from StageHost.poll; None while running
    host_lost: str | None = None  # the StageHost actor is gone (why)
    health: str | None = None  # "SERVING", "NOT_SERVING", ...; None when the RPC failed
    info: StageInfoView | None = None
    rpc_error: str | None = None


def judge(probe: StageProbe, *, starting: bool, misses: int, max_misses: int) -> tuple[Verdict, str | None]:
    """(verdict, reason); ``misses`` counts the consecutive non-serving checks before this one.

    While starting, anything short of SERVING is just STARTING (the startup deadline is enforced elsewhere).
    Once serving, a stage that is not SERVING (unreachable, slow, NOT_SERVING) is SUSPECT, unhealthy at once,
    but fails only after ``max_misses`` consecutive checks, so one slow answer under load does not cost a whole
    replica; a frozen stage is caught in ``max_misses`` intervals. DRAINING is an operator's choice: not
    healthy (the gateway skips it), not a failure (no restart). A stage that only missed checks is unhealthy,
    but the gateway still uses its replica when no replica is healthy (``MeshSnapshot.routable_replicas``).
    """
    if probe.host_lost is not None:
        return Verdict.FAILED, f"its StageHost is gone ({probe.host_lost})"
    if probe.exit_code is not None:
        return Verdict.FAILED, describe_exit(probe.exit_code)
    if probe.info is not None and probe.info.state is StageState.FAILED:
        return Verdict.FAILED, probe.info.error or "it reported FAILED"
    if probe.health == "SERVING":
        return Verdict.SERVING, None
    if probe.info is not None and probe.info.state is StageState.DRAINING:
        return Verdict.DRAINING, None
    if starting:
        return Verdict.STARTING, None
    detail = f"health {probe.health}" if probe.health else (probe.rpc_error or "no answer")
    if misses + 1 >= max_misses:
        return Verdict.FAILED, f"not serving for {misses + 1} consecutive checks ({detail})"
    return Verdict.SUSPECT, detail


class StageChannel:
    """A gRPC channel to one stage and its two probes, started without blocking (``start_probe``)."""

    # Reconnect fast: a stage's port appears a moment after its process starts and again after every
    # restart, and gRPC's default backoff would grow to minutes.
    _OPTIONS = [
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]

    def __init__(self, target: str, mesh_token: str = "", tls: TlsFiles | None = None) -> None:
        self.target = target
        # The probes' methods are open; the token rides along so a guarded method added later just works.
        self._metadata = call_metadata(mesh_token) if mesh_token else None
        self._channel = open_channel(target, tls, self._OPTIONS)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._stage = stage_pb2_grpc.StageStub(self._channel)

    def start_probe(self, timeout_s: float) -> tuple[Future, Future]:
        health = self._health.Check.future(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s,
                                           metadata=self._metadata)
        info = self._stage.GetStageInfo.future(stage_pb2.GetStageInfoRequest(), timeout=timeout_s,
                                               metadata=self._metadata)
        return health, info

    @staticmethod
    def finish_probe(futures: tuple[Future, Future]) -> tuple[str | None, StageInfoView | None, str | None]:
        """(health status name, info, first RPC error) from ``start_probe``'s futures."""
        health_future, info_future = futures
        health = info = error = None
        try:
            health = health_pb2.HealthCheckResponse.ServingStatus.Name(health_future.result().status)
        except grpc.RpcError as exc:
            error = f"health check: {exc.code().name}"
        try:
            info = info_view(info_future.result())
        except grpc.RpcError as exc:
            error = error or f"GetStageInfo: {exc.code().name}"
        except UnknownStateError as exc:
            error = error or f"GetStageInfo: {exc}"
        return health, info, error

    def close(self) -> None:
        self._channel.close()


def info_view(message: stage_pb2.StageInfo) -> StageInfoView:
    """``stagemesh.v1.StageInfo`` -> ``StageInfoView``; an unknown state raises ``UnknownStateError``."""
    return StageInfoView(
        state=state_from_proto(message.state),
        pid=int(message.pid),
        compute_dtype=message.compute_dtype,
        quantized=bool(message.quantized),
        error=message.error,
        blas=message.blas,
        weight_bytes=int(message.weight_bytes),
        stats=StageStats.from_proto(message.stats),
        backend=message.backend,
        device=message.device,
    )
