"""The gRPC face of a stage: ``stagemesh.v1.Stage``, standard health, and reflection.

Every stage serves ``GetStageInfo`` and ``Drain``; only the entry stage has an
engine and serves ``Generate`` and ``Abort`` (others answer
FAILED_PRECONDITION). Health (service ``""`` and ``stagemesh.v1.Stage``)
mirrors the stage's state: SERVING only while the stage is serving.
Handlers run on the server's thread pool and never touch MLX.
"""

from __future__ import annotations

import logging
import os
import queue
import uuid
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from stage_worker.engine import EntryEngine, NotAccepting, RequestFailed
from stage_worker.memory import peak_rss_bytes
from stage_worker.scheduler import Finish, GenerationRequest, QueueFullError, RequestError, RequestEvent
from stage_worker.stage_status import StageStatus
from stage_worker.wire import NO_SEED, SamplingParams
from stagemesh.core.states import StageState, state_to_proto
from stagemesh.core.v1 import stage_pb2, stage_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = stage_pb2.DESCRIPTOR.services_by_name["Stage"].full_name

_FINISH = {
    Finish.STOP: stage_pb2.FINISH_REASON_STOP,
    Finish.LENGTH: stage_pb2.FINISH_REASON_LENGTH,
    Finish.ABORT: stage_pb2.FINISH_REASON_ABORT,
}


@dataclass(frozen=True)
class StageDescription:
    """Static facts GetStageInfo reports."""

    replica: int
    rank: int
    world_size: int
    layers: tuple[int, int]
    num_layers: int
    host: str
    grpc_port: int
    ring_port: int
    lane_port: int
    node_id: str
    model: str
    compute_dtype: str
    max_num_seqs: int
    max_model_len: int
    version: str
    backend: str = ""  # MLX's backend: cpu, metal or cuda (stage_worker.device)
    device: str = ""  # the device's name: "NVIDIA H200", "Apple M2 Max (applegpu_g14s)", the CPU's model


class StageServicer(stage_pb2_grpc.StageServicer):
    def __init__(self, description: StageDescription, status: StageStatus) -> None:
        self._description = description
        self._status = status
        self.engine: EntryEngine | None = None  # set on the entry stage once it serves

    def GetStageInfo(self, request, context):
        d, stats = self._description, self._status.stats()
        return stage_pb2.StageInfo(
            replica=d.replica, rank=d.rank, world_size=d.world_size, layer_start=d.layers[0],
            layer_end=d.layers[1], num_layers=d.num_layers, host=d.host, grpc_port=d.grpc_port,
            ring_port=d.ring_port, lane_port=d.lane_port, pid=os.getpid(), node_id=d.node_id,
            model=d.model, compute_dtype=d.compute_dtype, quantized=self._status.quantized,
            state=state_to_proto(self._status.state), error=self._status.error,
            weight_bytes=self._status.weight_bytes, peak_rss_bytes=peak_rss_bytes(),
            max_num_seqs=d.max_num_seqs, max_model_len=d.max_model_len, version=d.version,
            stats=stats.to_proto(), blas=self._status.blas, backend=d.backend, device=d.device,
        )

    def Generate(self, request, context):
        engine = self._require_engine(context)
        sampling = request.sampling
        try:
            handle = engine.submit(GenerationRequest(
                request_id=request.request_id or uuid.uuid4().hex,
                prompt=tuple(request.prompt_token_ids),
                max_tokens=request.max_tokens,
                sampling=_sampling(sampling),
                stop_token_ids=frozenset(request.stop_token_ids),
                ignore_eos=request.ignore_eos,
            ))
        except RequestError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except QueueFullError as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except NotAccepting as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        # A cancelled call (client gone, deadline) frees the sequence on every stage.
        context.add_callback(lambda: engine.abort(handle.request_id))
        while True:
            event = _coalesce(handle.events)
            if isinstance(event, RequestFailed):
                context.abort(grpc.StatusCode.UNAVAILABLE, event.message)
            yield stage_pb2.GenerateResponse(
                token_ids=event.token_ids,
                finish_reason=_FINISH[event.finish] if event.finish else stage_pb2.FINISH_REASON_UNSPECIFIED,
                prompt_tokens=event.prompt_tokens,
                completion_tokens=event.completion_tokens,
            )
            if event.finish is not None:
                return

    def Abort(self, request, context):
        engine = self._require_engine(context)
        return stage_pb2.AbortResponse(found=engine.abort(request.request_id))

    def Drain(self, request, context):
        if self.engine is not None:
            running, waiting = self.engine.drain()
            return stage_pb2.DrainResponse(running=running, waiting=waiting)
        self._status.set_state(StageState.DRAINING)
        return stage_pb2.DrainResponse()

    def _require_engine(self, context) -> EntryEngine:
        if self._description.rank != 0:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"stage {self._description.rank} is not an entry stage; send Generate to rank 0")
        if self.engine is None:
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          f"the entry stage is {self._status.state.value}, not serving yet")
        assert self.engine is not None  # context.abort raises: it never returns
        return self.engine


def _coalesce(events: queue.SimpleQueue) -> RequestEvent | RequestFailed:
    """The next event, merged with every event already queued behind it (up to a finish or a failure).

    One message per token is the common case; but when this stream's thread falls behind the engine
    (many streams, one GIL, a fast GPU step), each extra message costs the stage and the gateway a
    full gRPC round of work for one token. Sending what has piled up as one message lets a busy
    stream catch up instead of falling further behind. ``token_ids`` already means "tokens since
    the previous message", so clients see the same tokens in the same order.
    """
    event = events.get()
    while isinstance(event, RequestEvent) and event.finish is None:
        try:
            following = events.get_nowait()
        except queue.Empty:
            break
        if isinstance(following, RequestFailed):
            return following
        event = RequestEvent(event.request_id, event.token_ids + following.token_ids, following.finish,
                             following.prompt_tokens, following.completion_tokens)
    return event


def _sampling(params: stage_pb2.SamplingParams) -> SamplingParams:
    temperature = params.temperature
    top_p = params.top_p if params.top_p > 0 else 1.0
    if not 0 <= temperature <= 2:
        raise RequestError(f"sampling.temperature must be in [0, 2], got {temperature}")
    if not 0 < top_p <= 1:
        raise RequestError(f"sampling.top_p must be in (0, 1], got {top_p}")
    if params.top_k < 0:
        raise RequestError(f"sampling.top_k must be 0 (disabled) or positive, got {params.top_k}")
    seed = params.seed if params.HasField("seed") else NO_SEED
    return SamplingParams(temperature=temperature, top_p=top_p, top_k=params.top_k, seed=seed)


def start_grpc_server(
    description: StageDescription, status: StageStatus, max_workers: int
) -> tuple[grpc.Server, StageServicer]:
    """Bind ``host:grpc_port`` (only that interface), serve Stage + health + reflection."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
                         options=[("grpc.so_reuseport", 0)])
    servicer = StageServicer(description, status)
    stage_pb2_grpc.add_StageServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )

    def mirror(state: StageState) -> None:
        serving = health_pb2.HealthCheckResponse.SERVING if state == StageState.SERVING \
            else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            health_servicer.set(name, serving)

    status.on_state(mirror)
    address = f"{description.host}:{description.grpc_port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as exc:
        raise OSError(f"cannot bind gRPC on {address}: {exc}") from exc
    if bound == 0:
        raise OSError(f"cannot bind gRPC on {address}: the port is busy; choose another --grpc-base-port")
    server.start()
    return server, servicer
