"""The gRPC face of a stage: ``stagemesh.v1.Stage``, standard health, and reflection.

Every stage serves ``GetStageInfo`` and ``Drain``; only the entry stage has an engine and serves
``GenerateStream`` and ``Abort`` (others answer FAILED_PRECONDITION). A prompt's sampling is converted from the
proto and checked here by the core's one ``stagemesh_core.sampling.check`` (the gateway ran it already; other
callers, grpcurl or a benchmark, get the same named INVALID_ARGUMENT), and nothing past this boundary checks
it again. Health (service ``""`` and ``stagemesh.v1.Stage``) is SERVING only while the stage is serving. Every
method but health, reflection and ``GetStageInfo`` requires the mesh token (``stage_worker.service.auth_interceptor``).
``start_grpc_server`` runs it all on grpc.aio, on an event loop of its own thread (``StageGrpcServer``);
handlers never touch MLX.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import random
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from stage_worker.engine.entry_engine import EntryEngine, NotAccepting, RequestFailed, RequestHandle
from stage_worker.engine.scheduler import Finish, GenerationRequest, QueueFullError, RequestError, RequestEvent
from stage_worker.engine.stage_status import StageStatus
from stage_worker.service.auth_interceptor import MeshTokenInterceptor
from stage_worker.service.memory import peak_rss_bytes
from stagemesh_core import sampling
from stagemesh_core.grpc_tls import TlsFiles, server_credentials
from stagemesh_core.states import StageState, state_to_proto
from stagemesh_core.v1 import stage_pb2, stage_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = stage_pb2.DESCRIPTOR.services_by_name["Stage"].full_name

_FINISH = {
    Finish.STOP: stage_pb2.FINISH_REASON_STOP,
    Finish.LENGTH: stage_pb2.FINISH_REASON_LENGTH,
    Finish.ABORT: stage_pb2.FINISH_REASON_ABORT,
}
_START_TIMEOUT_S = 30.0
# The gateway keeps one GenerateStream call open to each entry stage, idle between requests, and
# pings it every 20 s (gateway.config) to notice a dead host. gRPC's server default answers pings
# closer than 5 min apart without data with GOAWAY "too_many_pings" after two, which would end an
# idle call (and any request waiting out a long prefill). Accept one every 10 s.
SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.so_reuseport", 0),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
)


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
    backend: str = ""  # MLX's backend: cpu, metal or cuda (stage_worker.model.device)
    device: str = ""  # the device's name: "NVIDIA H200", "Apple M2 Max (applegpu_g14s)", the CPU's model


class StageServicer(stage_pb2_grpc.StageServicer):
    """The Stage service; its coroutines run on the server's event loop (``loop``)."""

    def __init__(self, description: StageDescription, status: StageStatus, loop: asyncio.AbstractEventLoop) -> None:
        self._description = description
        self._status = status
        self._loop = loop
        self._wakeups: dict[str, asyncio.Event] = {}  # request id -> set when its handle got events
        self._streams: set[_StreamCall] = set()  # GenerateStream calls in progress
        self._closing = False  # the server is stopping: a GenerateStream call ends once nothing runs on it
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

    async def GenerateStream(self, request_iterator, context):
        """Many prompts over one call (the gateway's path): one wake-up per engine step for all of them,
        answered by one message holding every prompt's news (``stage.proto``'s contract)."""
        engine = await self._require_engine(context)
        await context.send_initial_metadata(())  # accepted: the client may write (stage.proto)
        call = _StreamCall(engine, self._wakeups)
        self._streams.add(call)
        reading = asyncio.ensure_future(call.read(request_iterator))
        reading.add_done_callback(call.reader_done)
        try:
            # The call ends once nothing runs on it and the client's side is closed or the server is
            # stopping (a gateway keeps its call open for the next request; a stopping server's grace
            # period should not wait for that).
            async for updates in call.updates(lambda: reading.done() or self._closing):
                yield stage_pb2.GenerateStreamResponse(updates=updates)
        finally:
            self._streams.discard(call)
            reading.cancel()
            call.abort_all()

    def close_streams(self) -> None:
        """On the loop, as the server stops: every GenerateStream call ends as soon as its requests have."""
        self._closing = True
        for call in self._streams:
            call.wakeup.set()

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
                                f"stage {self._description.rank} is not an entry stage; send GenerateStream to rank 0")
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"the entry stage is {self._status.state.value}, not serving yet")
        assert self.engine is not None  # context.abort raises: it never returns
        return self.engine


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
                             event.logprobs + following.logprobs, following.cached_tokens)
    return event


class _Refused(Exception):
    """A prompt the engine would not take, with the status code its update carries."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def _submit(engine: EntryEngine, request: stage_pb2.GenerateRequest, request_id: str) -> RequestHandle:
    """Hand ``request`` to the engine; ``_Refused`` says why it would not take it."""
    try:
        return engine.submit(_generation_request(request, request_id))
    except QueueFullError as exc:
        raise _Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from None
    except NotAccepting as exc:
        raise _Refused(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
    except ValueError as exc:  # SamplingError and RequestError included: a bad field, named
        raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None


def _response(event: RequestEvent) -> stage_pb2.GenerateResponse:
    return stage_pb2.GenerateResponse(
        token_ids=event.token_ids,
        finish_reason=_FINISH[event.finish] if event.finish else stage_pb2.FINISH_REASON_UNSPECIFIED,
        prompt_tokens=event.prompt_tokens,
        completion_tokens=event.completion_tokens,
        cached_tokens=event.cached_tokens,
        logprobs=[_logprob_proto(t, lp) for t, lp in zip(event.token_ids, event.logprobs, strict=False)],
    )


class _StreamCall:
    """The prompts of one ``GenerateStream`` call and the one wake-up they share.

    Everything here runs on the server's event loop; the engine's thread only queues events on the
    handles and sets ``wakeup`` through ``StageServicer.on_delivered``.
    """

    def __init__(self, engine: EntryEngine, wakeups: dict[str, asyncio.Event]) -> None:
        self._engine = engine
        self._wakeups = wakeups  # the servicer's: request id -> the event the engine's wake-up sets
        self.wakeup = asyncio.Event()
        self.running: dict[str, RequestHandle] = {}
        self._refused: list[stage_pb2.GenerateUpdate] = []  # errors not sent yet

    async def read(self, request_iterator) -> None:
        async for message in request_iterator:
            action = message.WhichOneof("action")
            if action == "start":
                self._start(message.start)
            elif action == "cancel":
                self._cancel(message.cancel)
        self.wakeup.set()  # the client closed its side: the call may end once nothing runs

    def reader_done(self, task: asyncio.Future) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.debug("GenerateStream: reading the client's side failed: %s", task.exception())
        self.wakeup.set()

    def _start(self, request: stage_pb2.GenerateRequest) -> None:
        request_id = request.request_id
        try:
            if not request_id:
                raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, "GenerateStream: start.request_id is required")
            handle = _submit(self._engine, request, request_id)
        except _Refused as exc:
            self._refused.append(stage_pb2.GenerateUpdate(request_id=request_id, error_code=exc.code.value[0],
                                                          error_message=exc.message))
            self.wakeup.set()
            return
        self.running[request_id] = handle
        self._wakeups[request_id] = self.wakeup

    def _cancel(self, request_id: str) -> None:
        if self.running.pop(request_id, None) is not None:
            self._wakeups.pop(request_id, None)
            self._engine.abort(request_id)

    async def updates(self, ended: Callable[[], bool]) -> AsyncIterator[list[stage_pb2.GenerateUpdate]]:
        """Each batch of updates as it comes, waiting on the wake-up in between; stops once ``ended()``
        and no prompt runs.

        Clearing the wake-up before looking closes the race with the engine's thread: it queues an event
        first and wakes the loop after, so an event is either collected here or followed by a ``set``
        this coroutine then awaits.
        """
        while True:
            self.wakeup.clear()
            updates = self.collect()
            if updates:
                yield updates
            elif ended() and not self.running:
                return
            else:
                await self.wakeup.wait()

    def collect(self) -> list[stage_pb2.GenerateUpdate]:
        """Every prompt's events queued since the last look, one update each; finished prompts leave."""
        updates, self._refused = self._refused, []
        for request_id, handle in list(self.running.items()):
            try:
                event = _coalesce(handle.events.get_nowait(), handle.events)
            except queue.Empty:
                continue
            if isinstance(event, RequestFailed):
                updates.append(stage_pb2.GenerateUpdate(
                    request_id=request_id, error_code=grpc.StatusCode.UNAVAILABLE.value[0],
                    error_message=event.message))
            else:
                updates.append(stage_pb2.GenerateUpdate(request_id=request_id, response=_response(event)))
                if event.finish is None:
                    continue
            del self.running[request_id]
            self._wakeups.pop(request_id, None)
        return updates

    def abort_all(self) -> None:
        """The call ended (the client cancelled it or went away): free every prompt still running."""
        for request_id in list(self.running):
            self._cancel(request_id)


def _generation_request(request: stage_pb2.GenerateRequest, request_id: str) -> GenerationRequest:
    """The engine's request; ``ValueError`` (``SamplingError``, ``RequestError``) names a bad field."""
    params = sampling.from_proto(request.sampling)
    sampling.check(params, max_tokens=request.max_tokens, name=_field_name)
    if params.seed is None and not params.greedy:
        # Drawn once per request: its records carry it every step (the sampler's key mixes in the position,
        # so each step draws afresh), and the pipeline has no record to re-seed on its way.
        params = replace(params, seed=random.getrandbits(62))
    if params.grammar and (request.ignore_eos or not request.stop_token_ids):
        raise RequestError("a grammar (constrained decoding) needs stop_token_ids and not ignore_eos: "
                           "the output ends where the grammar does")
    return GenerationRequest(request_id=request_id, prompt=tuple(request.prompt_token_ids),
                             max_tokens=request.max_tokens, sampling=params,
                             stop_token_ids=frozenset(request.stop_token_ids), ignore_eos=request.ignore_eos)


def _field_name(field: str) -> str:
    """A field as ``GenerateRequest`` names it (the sampling's sit in ``sampling``)."""
    return field if field == "max_tokens" else f"sampling.{field}"


def _logprob_proto(token_id: int, logprob) -> stage_pb2.TokenLogprob:
    return stage_pb2.TokenLogprob(
        token_id=token_id, logprob=logprob.logprob,
        top=[stage_pb2.TopLogprob(token_id=t, logprob=v) for t, v in logprob.top],
    )


class StageGrpcServer:
    """The stage's aio gRPC server and the thread whose event loop runs it.

    A thread of its own, because the process's main thread runs the engine (MLX streams belong to the thread
    that made them). grpc.aio, because on a GPU a step is short and every token of every stream is a gRPC
    message: grpcio's thread-pool server hands each message between a handler thread and its polling thread
    under conditions, three GIL hand-offs per token, all contending with the engine's thread for the one GIL.
    Here the engine wakes the loop once per step for every stream that got tokens
    (``StageServicer.on_delivered``), and each stream's handler sends from the loop itself.
    """

    def __init__(self, server: grpc.aio.Server, servicer: StageServicer, loop: asyncio.AbstractEventLoop,
                 thread: threading.Thread) -> None:
        self._server, self._servicer, self._loop, self._thread = server, servicer, loop, thread

    def stop(self, grace: float | None) -> None:
        """Stop serving (calls in flight get ``grace`` seconds), then end the loop's thread."""
        if not self._thread.is_alive():
            return
        try:
            self._loop.call_soon_threadsafe(self._servicer.close_streams)
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
    return StageGrpcServer(server, servicer, loop, thread), servicer


async def _start(description: StageDescription, status: StageStatus, mesh_token: str, tls: TlsFiles | None,
                 loop: asyncio.AbstractEventLoop) -> tuple[grpc.aio.Server, StageServicer, health.aio.HealthServicer]:
    server = grpc.aio.server(interceptors=[MeshTokenInterceptor(mesh_token)], options=list(SERVER_OPTIONS))
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
