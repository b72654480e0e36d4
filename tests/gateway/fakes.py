"""Test doubles for the gateway: a real grpc.aio Stage server with a scripted
"model", a MeshView over it, and uvicorn serving an app in a thread.

The fake stage "generates" ``reply_ids`` one token per message (then EOS
when ``end_with_eos``), honours max_tokens / stop_token_ids / ignore_eos like
the real entry stage, records every request and every cancellation, and can
be told to fail before or after the first token.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio
import uvicorn

from stagemesh_core.snapshots import MeshSnapshot, ReplicaSnapshot, StageSnapshot, StageStats
from stagemesh_core.states import StageState
from stagemesh_core.v1 import stage_pb2, stage_pb2_grpc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Script:
    reply_ids: list[int] = field(default_factory=list)
    end_with_eos: bool = True
    chunk: int = 1  # tokens per message
    delay_s: float = 0.0  # before each message
    fail_before: grpc.StatusCode | None = None
    fail_after_tokens: int | None = None  # UNAVAILABLE after this many tokens
    hang_after_tokens: int | None = None  # then wait until cancelled
    cached_tokens: int = 0  # the prompt positions every message says the prefix cache restored


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class FakeStage(stage_pb2_grpc.StageServicer):
    """The scripted stage's ``GenerateStream``, answered like the real entry stage's: each prompt runs the
    script and its messages travel as updates of the one call (everything queued when the call wakes goes
    out as one message); a prompt's failure ends that prompt only, with its status code."""

    def __init__(self, eos_id: int) -> None:
        self.eos_id = eos_id
        self.script = Script()
        self.requests: list[stage_pb2.GenerateRequest] = []
        self.cancelled: list[str] = []
        self.finished: list[str] = []
        self.stream_calls = 0

    def reset(self, **kwargs: object) -> None:
        self.script = Script(**kwargs)  # type: ignore[arg-type]
        self.requests.clear()
        self.cancelled.clear()
        self.finished.clear()

    async def _scripted(self, request: stage_pb2.GenerateRequest):
        """One prompt's messages as the script says; ``_Aborted`` ends it with a status code."""
        self.requests.append(request)
        s = self.script
        if s.fail_before is not None:
            raise _Aborted(s.fail_before, f"fake stage refuses: {s.fail_before.name}")
        stops = set(request.stop_token_ids)
        out: list[int] = []
        ids = list(s.reply_ids) + ([self.eos_id] if s.end_with_eos else [])
        try:
            i = 0
            while True:
                if s.delay_s:
                    await asyncio.sleep(s.delay_s)
                if s.hang_after_tokens is not None and len(out) >= s.hang_after_tokens:
                    await asyncio.sleep(3600)
                if s.fail_after_tokens is not None and len(out) >= s.fail_after_tokens:
                    raise _Aborted(grpc.StatusCode.UNAVAILABLE, "fake stage: ring peer lost")
                batch: list[int] = []
                finish = stage_pb2.FINISH_REASON_UNSPECIFIED
                while len(batch) < s.chunk:
                    token = ids[i % len(ids)] if ids else 7
                    i += 1
                    batch.append(token)
                    if token in stops and not request.ignore_eos:
                        finish = stage_pb2.FINISH_REASON_STOP
                        break
                    if len(out) + len(batch) >= request.max_tokens:
                        finish = stage_pb2.FINISH_REASON_LENGTH
                        break
                out.extend(batch)
                yield stage_pb2.GenerateResponse(token_ids=batch, finish_reason=finish,
                                                 prompt_tokens=len(request.prompt_token_ids),
                                                 completion_tokens=len(out), cached_tokens=s.cached_tokens)
                if finish:
                    self.finished.append(request.request_id)
                    return
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise

    async def GenerateStream(self, request_iterator, context):  # noqa: N802 - gRPC name
        await context.send_initial_metadata(())  # accepted (stage.proto: clients wait for it)
        self.stream_calls += 1
        updates: asyncio.Queue[stage_pb2.GenerateUpdate | None] = asyncio.Queue()
        prompts: dict[str, asyncio.Task] = {}

        async def run(request: stage_pb2.GenerateRequest) -> None:
            try:
                async for response in self._scripted(request):
                    updates.put_nowait(stage_pb2.GenerateUpdate(request_id=request.request_id, response=response))
            except _Aborted as exc:
                updates.put_nowait(stage_pb2.GenerateUpdate(request_id=request.request_id,
                                                            error_code=exc.code.value[0], error_message=exc.details))
            finally:
                prompts.pop(request.request_id, None)

        async def read() -> None:
            async for message in request_iterator:
                if message.WhichOneof("action") == "start":
                    prompts[message.start.request_id] = asyncio.ensure_future(run(message.start))
                elif (task := prompts.pop(message.cancel, None)) is not None:
                    task.cancel()
            updates.put_nowait(None)

        reader = asyncio.ensure_future(read())
        try:
            closed = False
            while not (closed and not prompts and updates.empty()):
                first = await updates.get()
                batch = [first] if first is not None else []
                closed = closed or first is None
                while not updates.empty():
                    item = updates.get_nowait()
                    closed = closed or item is None
                    if item is not None:
                        batch.append(item)
                if batch:
                    yield stage_pb2.GenerateStreamResponse(updates=batch)
                if closed and prompts:
                    await asyncio.gather(*prompts.values(), return_exceptions=True)
        finally:
            reader.cancel()
            for task in list(prompts.values()):
                task.cancel()


class StageServer:
    """A grpc.aio server on 127.0.0.1 in its own thread and event loop."""

    def __init__(self, servicer: FakeStage) -> None:
        self.servicer = servicer
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: grpc.aio.Server | None = None

    def start(self) -> StageServer:
        self._thread.start()

        async def boot() -> int:
            self._server = grpc.aio.server()
            stage_pb2_grpc.add_StageServicer_to_server(self.servicer, self._server)
            port = self._server.add_insecure_port("127.0.0.1:0")
            await self._server.start()
            return port

        self.port = asyncio.run_coroutine_threadsafe(boot(), self._loop).result(10)
        return self

    def stop(self) -> None:
        if self._server is not None:
            asyncio.run_coroutine_threadsafe(self._server.stop(0), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@dataclass
class FakeMesh:
    """A MeshView: one single-stage replica per port; flip ``healthy`` per replica; ``pid_base`` + the
    replica is each stage's pid (change it: a new process serves the port); ``supervision`` gives a replica
    the coordinator's view of it (``ReplicaSnapshot`` fields: state, restarts, backoff ...)."""

    ports: list[int]
    model: str = "SmolLM2-135M-Instruct"
    healthy: dict[int, bool] = field(default_factory=dict)
    suspect: set[int] = field(default_factory=set)  # replicas serving whose stage missed its latest check
    pid_base: int = 1000
    supervision: dict[int, dict[str, Any]] = field(default_factory=dict)

    def snapshot(self) -> MeshSnapshot:
        replicas = []
        for r, port in enumerate(self.ports):
            ok = self.healthy.get(r, True) and r not in self.suspect
            stage = StageSnapshot(
                rank=0, layers=(0, 30), host="127.0.0.1", grpc_port=port, ring_port=0, pid=self.pid_base + r,
                node_id=f"node-{r}", compute_dtype="float32", quantized=False, healthy=ok, backend="cpu",
                device="fake CPU",
                state=StageState.SERVING if ok or r in self.suspect else StageState.FAILED,
                stats=StageStats(batches=10 + r, tokens=99, compute_seconds=1.5, wait_seconds=0.25,
                                         send_seconds=0.125, running_sequences=r, waiting_requests=0,
                                         prefix_cache_queries=400, prefix_cache_hits=96, prefix_cache_blocks=7,
                                         prefix_cache_evictions=2),
            )
            replicas.append(ReplicaSnapshot(replica=r, stages=(stage,), **self.supervision.get(r, {})))
        return MeshSnapshot(model=self.model, replicas=tuple(replicas))


class AppServer:
    """uvicorn serving ``app`` on 127.0.0.1 in a thread."""

    def __init__(self, app: object) -> None:
        self.port = free_port()
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="on", timeout_graceful_shutdown=2))
        self._thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> AppServer:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(10)


def wait_for(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()
