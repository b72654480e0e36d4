"""The gRPC face of a stage: ``stagemesh.v1.Stage``, standard health, and reflection.

Every stage serves ``GetStageInfo`` and ``Drain``; only the entry stage has an
engine and serves ``Generate`` and ``Abort`` (others answer
FAILED_PRECONDITION). Health (service ``""`` and ``stagemesh.v1.Stage``)
mirrors the stage's state: SERVING only while the stage is serving. Every
method but health, reflection and ``GetStageInfo`` requires the mesh token
(``stage_worker.auth_interceptor``).

The server is grpc.aio on an event loop of its own thread (``StageGrpcServer``),
because the process's main thread runs the engine (MLX streams belong to the
thread that made them). Why aio: on a GPU a step takes a few ms and every
token of every stream is a gRPC message. grpcio's thread-pool server hands
each message between a handler thread and its polling thread under
conditions, three GIL hand-offs per token, all contending with the engine's
thread for the one GIL (py-spy on an H200: a third of the stage's GIL time at
16 streams). Here the engine wakes the loop once per step for every stream
that got tokens (``StageServicer.on_delivered``), and each stream's handler
sends from the loop itself. Handlers never touch MLX.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import uuid
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from stage_worker.auth_interceptor import MeshTokenInterceptor
from stage_worker.engine import EntryEngine, NotAccepting, RequestFailed, RequestHandle
from stage_worker.memory import peak_rss_bytes
from stage_worker.row_options import MAX_TOP_LOGPROBS, NO_LOGPROBS, RowOptions
from stage_worker.scheduler import Finish, GenerationRequest, QueueFullError, RequestError, RequestEvent
from stage_worker.stage_status import StageStatus
from stage_worker.wire import NO_SEED, SamplingParams
from stagemesh.core.grpc_tls import TlsFiles, server_credentials
from stagemesh.core.states import StageState, state_to_proto
from stagemesh.core.v1 import stage_pb2, stage_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = stage_pb2.DESCRIPTOR.services_by_name["Stage"].full_name

_FINISH = {
    Finish.STOP: stage_pb2.FINISH_REASON_STOP,
    Finish.LENGTH: stage_pb2.FINISH_REASON_LENGTH,
    Finish.ABORT: stage_pb2.FINISH_REASON_ABORT,
}
_START_TIMEOUT_S = 30.0


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
    """The Stage service; its coroutines run on the server's event loop (``loop``)."""

    def __init__(self, description: StageDescription, status: StageStatus, loop: asyncio.AbstractEventLoop) -> None:
        self._description = description
        self._status = status
        self._loop = loop
        self._wakeups: dict[str, asyncio.Event] = {}  # request id -> set when its handle got events
        self.engine: EntryEngine | None = None  # set on the entry stage once it serves

    def on_delivered(self, request_ids: list[str]) -> None:
        """The engine's hook (``EntryEngine(on_delivered=...)``), from any thread: one wake-up of the loop
        for every stream that got events this step."""
        self._loop.call_soon_threadsafe(self._wake, request_ids)

    def _wake(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            wakeup = self._wakeups.get(request_id)
            if wakeup is not None:
                wakeup.set()

    async def GetStageInfo(self, request, context):
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

    async def Generate(self, request, context):
        engine = await self._require_engine(context)
        sampling = request.sampling
        try:
            options = _row_options(request)
            handle = engine.submit(GenerationRequest(
                request_id=request.request_id or uuid.uuid4().hex,
                prompt=tuple(request.prompt_token_ids),
                max_tokens=request.max_tokens,
                sampling=_sampling(sampling),
                stop_token_ids=frozenset(request.stop_token_ids),
                ignore_eos=request.ignore_eos,
                options=None if options.is_default else options,
            ))
        except RequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except QueueFullError as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except NotAccepting as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        wakeup = self._wakeups[handle.request_id] = asyncio.Event()
        finished = False
        try:
            while not finished:
                event = await _next_event(handle, wakeup)
                if isinstance(event, RequestFailed):
                    finished = True
                    await context.abort(grpc.StatusCode.UNAVAILABLE, event.message)
                assert isinstance(event, RequestEvent)
                finished = event.finish is not None
                yield stage_pb2.GenerateResponse(
                    token_ids=event.token_ids,
                    finish_reason=_FINISH[event.finish] if event.finish else stage_pb2.FINISH_REASON_UNSPECIFIED,
                    prompt_tokens=event.prompt_tokens,
                    completion_tokens=event.completion_tokens,
                    logprobs=[_logprob_proto(t, lp) for t, lp in zip(event.token_ids, event.logprobs, strict=False)],
                )
        finally:
            # A cancelled call (client gone, deadline) ends here too: free the sequence on every stage.
            self._wakeups.pop(handle.request_id, None)
            if not finished:
                engine.abort(handle.request_id)

    async def Abort(self, request, context):
        engine = await self._require_engine(context)
        return stage_pb2.AbortResponse(found=engine.abort(request.request_id))

    async def Drain(self, request, context):
        if self.engine is not None:
            running, waiting = self.engine.drain()
            return stage_pb2.DrainResponse(running=running, waiting=waiting)
        self._status.set_state(StageState.DRAINING)
        return stage_pb2.DrainResponse()

    async def _require_engine(self, context) -> EntryEngine:
        if self._description.rank != 0:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"stage {self._description.rank} is not an entry stage; send Generate to rank 0")
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"the entry stage is {self._status.state.value}, not serving yet")
        assert self.engine is not None  # context.abort raises: it never returns
        return self.engine


async def _next_event(handle: RequestHandle, wakeup: asyncio.Event) -> RequestEvent | RequestFailed:
    """The handle's next event, merged with what is queued behind it; waits for a wake-up when there is none.

    Clearing the wake-up before looking closes the race with the engine's thread: it queues an event
    first and wakes the loop after, so an event is either seen here or followed by a ``set`` this
    coroutine then awaits.
    """
    while True:
        wakeup.clear()
        try:
            return _coalesce(handle.events.get_nowait(), handle.events)
        except queue.Empty:
            await wakeup.wait()


def _coalesce(event: RequestEvent | RequestFailed, events: queue.SimpleQueue) -> RequestEvent | RequestFailed:
    """``event`` merged with every event already queued behind it (up to a finish or a failure).

    One message per token is the common case; but when a stream falls behind the engine (many
    streams, a fast GPU step), each extra message costs the stage and the gateway a full gRPC round
    of work for one token. Sending what has piled up as one message lets a busy stream catch up
    instead of falling further behind. ``token_ids`` already means "tokens since the previous
    message" (and ``logprobs`` holds one entry per token when asked for), so clients see the same
    tokens, with the same logprobs, in the same order.
    """
    while isinstance(event, RequestEvent) and event.finish is None:
        try:
            following = events.get_nowait()
        except queue.Empty:
            break
        if isinstance(following, RequestFailed):
            return following
        event = RequestEvent(event.request_id, event.token_ids + following.token_ids, following.finish,
                             following.prompt_tokens, following.completion_tokens,
                             event.logprobs + following.logprobs)
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


def _row_options(request: stage_pb2.GenerateRequest) -> RowOptions:
    """The request's options for the last stage's logits processors; RequestError names a bad field."""
    p = request.sampling
    for name, low, high in (("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0),
                            ("min_p", 0.0, 1.0)):
        value = getattr(p, name)
        if not low <= value <= high:
            raise RequestError(f"sampling.{name} must be in [{low:g}, {high:g}], got {value}")
    repetition = p.repetition_penalty or 1.0  # proto3's unset 0 means the default
    if not 0.0 < repetition <= 2.0:
        raise RequestError(f"sampling.repetition_penalty must be in (0, 2], got {repetition}")
    for token, bias in p.logit_bias.items():
        if token < 0 or not -100.0 <= bias <= 100.0:
            raise RequestError(f"sampling.logit_bias: token {token} -> {bias}: ids >= 0, biases in [-100, 100]")
    if any(t < 0 for t in p.allowed_token_ids):
        raise RequestError("sampling.allowed_token_ids must hold token ids >= 0")
    if p.min_tokens > request.max_tokens:
        raise RequestError(f"sampling.min_tokens ({p.min_tokens}) must not exceed max_tokens ({request.max_tokens})")
    logprobs = p.logprobs if p.HasField("logprobs") else NO_LOGPROBS
    if logprobs > MAX_TOP_LOGPROBS:
        raise RequestError(f"sampling.logprobs must be at most {MAX_TOP_LOGPROBS}, got {logprobs}")
    stops = () if request.ignore_eos else tuple(sorted(set(request.stop_token_ids)))
    if p.grammar and not stops:
        raise RequestError("a grammar (constrained decoding) needs stop_token_ids and not ignore_eos: "
                           "the output ends where the grammar does")
    return RowOptions(
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty, repetition_penalty=repetition,
        logit_bias=tuple(sorted(p.logit_bias.items())), allowed_token_ids=tuple(p.allowed_token_ids),
        min_p=p.min_p, min_tokens=p.min_tokens if stops else 0,
        stop_token_ids=stops if p.min_tokens or p.grammar else (), grammar=p.grammar,
        prompt_len=len(request.prompt_token_ids),
        prompt_token_ids=tuple(request.prompt_token_ids) if repetition != 1.0 else (), logprobs=logprobs,
    )


def _logprob_proto(token_id: int, logprob) -> stage_pb2.TokenLogprob:
    return stage_pb2.TokenLogprob(
        token_id=token_id, logprob=logprob.logprob,
        top=[stage_pb2.TopLogprob(token_id=t, logprob=v) for t, v in logprob.top],
    )


class StageGrpcServer:
    """The stage's aio gRPC server and the thread whose event loop runs it."""

    def __init__(self, server: grpc.aio.Server, loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
        self._server, self._loop, self._thread = server, loop, thread

    def stop(self, grace: float | None) -> None:
        """Stop serving (calls in flight get ``grace`` seconds), then end the loop's thread."""
        if not self._thread.is_alive():
            return
        try:
            asyncio.run_coroutine_threadsafe(self._server.stop(grace), self._loop).result((grace or 0) + 10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)


def start_grpc_server(
    description: StageDescription, status: StageStatus, *, mesh_token: str, tls: TlsFiles | None = None,
) -> tuple[StageGrpcServer, StageServicer]:
    """Bind ``host:grpc_port`` (only that interface), serve Stage + health + reflection from a new event-loop
    thread; every method but health, reflection and GetStageInfo requires ``mesh_token``
    (``auth_interceptor``); with ``tls`` the port is mutual TLS and refuses any client without a certificate
    from the mesh's CA. Raises OSError when the port cannot be bound."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="grpc-aio", daemon=True)
    thread.start()
    try:
        server, servicer, health_servicer = asyncio.run_coroutine_threadsafe(
            _start(description, status, mesh_token, tls, loop), loop).result(_START_TIMEOUT_S)
    except BaseException:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        raise

    def mirror(state: StageState) -> None:
        # From any thread, the loop's own included (Drain): schedule, never wait.
        serving = health_pb2.HealthCheckResponse.SERVING if state == StageState.SERVING \
            else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            asyncio.run_coroutine_threadsafe(health_servicer.set(name, serving), loop)

    status.on_state(mirror)
    return StageGrpcServer(server, loop, thread), servicer


async def _start(description: StageDescription, status: StageStatus, mesh_token: str, tls: TlsFiles | None,
                 loop: asyncio.AbstractEventLoop) -> tuple[grpc.aio.Server, StageServicer, health.aio.HealthServicer]:
    server = grpc.aio.server(interceptors=[MeshTokenInterceptor(mesh_token)], options=[("grpc.so_reuseport", 0)])
    servicer = StageServicer(description, status, loop)
    stage_pb2_grpc.add_StageServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    address = f"{description.host}:{description.grpc_port}"
    try:
        bound = server.add_secure_port(address, server_credentials(tls)) if tls else server.add_insecure_port(address)
    except RuntimeError as exc:
        raise OSError(f"cannot bind gRPC on {address}: {exc}") from exc
    if bound == 0:
        raise OSError(f"cannot bind gRPC on {address}: the port is busy; choose another --grpc-base-port")
    await server.start()
    return server, servicer, health_servicer
