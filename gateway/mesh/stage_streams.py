"""Many generations over one gRPC call per entry stage: the gateway's end of ``Stage.GenerateStream``.

Contract:
- ``StageStream(stub, metadata)`` opens one ``GenerateStream`` call to an entry stage, in the running event
  loop, and a task that reads it. ``await start(request, timeout_s)`` writes the request's start and returns
  its ``StreamedGeneration``. ``closed`` turns true once the call has ended (the stage died, the connection
  broke, ``close()``); the client then opens a new stream for new work.
- A ``StreamedGeneration`` is to its caller what a call of its own would be: iterate it for
  ``GenerateResponse`` messages, ending after the one whose ``finish_reason`` is set; it raises
  ``grpc.aio.AioRpcError`` with the request's status code. ``cancel()`` is synchronous (safe in a ``finally``
  of a task being cancelled) and tells the stage to abort the request unless it ended.
``gateway.mesh.replica_client`` keeps one ``StageStream`` per entry stage.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, TypeAlias

import grpc
import grpc.aio

from stagemesh_core.v1 import stage_pb2

log = logging.getLogger(__name__)

_STATUS_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}
_Item: TypeAlias = "stage_pb2.GenerateResponse | grpc.aio.AioRpcError"


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """An error shaped like a failed call's, so callers keep one error path for both kinds of call."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class StreamedGeneration:
    """One request's share of a ``StageStream``.

    Its errors: the request's own error from the stage; the call's failure, for every request on it; and
    DEADLINE_EXCEEDED ``timeout_s`` after the start, which also aborts the request on the stage.
    """

    def __init__(self, stream: StageStream, request_id: str, timeout_s: float) -> None:
        self.request_id = request_id
        self._stream = stream
        self._items: asyncio.Queue[_Item] = asyncio.Queue()
        self._ended = False
        self._deadline = asyncio.get_running_loop().call_later(timeout_s, self._expire, timeout_s)

    def __aiter__(self) -> StreamedGeneration:
        return self

    async def __anext__(self) -> stage_pb2.GenerateResponse:
        if self._ended:
            raise StopAsyncIteration
        item = await self._items.get()
        if isinstance(item, grpc.aio.AioRpcError):
            self._end()
            raise item
        if item.finish_reason != stage_pb2.FINISH_REASON_UNSPECIFIED:
            self._end()
        return item

    def cancel(self) -> None:
        if not self._ended:
            self._end()
            self._stream.send_cancel(self.request_id)

    # -- from the stream's reader -------------------------------------------------
    def deliver(self, update: stage_pb2.GenerateUpdate) -> None:
        if update.error_code:
            code = _STATUS_BY_VALUE.get(update.error_code, grpc.StatusCode.UNKNOWN)
            self._items.put_nowait(rpc_error(code, update.error_message))
        else:
            self._items.put_nowait(update.response)

    def fail(self, error: grpc.aio.AioRpcError) -> None:
        self._items.put_nowait(error)

    def _expire(self, timeout_s: float) -> None:
        # Like a call's deadline: the caller sees DEADLINE_EXCEEDED and the stage frees the sequence.
        self._items.put_nowait(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, f"Deadline Exceeded ({timeout_s:g} s)"))
        self._stream.send_cancel(self.request_id)

    def _end(self) -> None:
        self._ended = True
        self._deadline.cancel()
        self._stream.forget(self.request_id)


class StageStream:
    """One ``GenerateStream`` call to one entry stage and the generations riding on it.

    Why one call: a step on a GPU is short (docs/performance.md has the figures), and a message per token per
    request would be written by the stage's event loop (which shares the GIL with the thread that builds the
    next step) and read by the gateway's. Over ``GenerateStream`` the stage sends one message per step holding
    every request's new tokens, and the gateway reads one and hands each request its part.
    """

    def __init__(self, stub: Any, metadata: Any) -> None:
        self._call = stub.GenerateStream(metadata=metadata)  # no deadline: each generation has its own
        self._generations: dict[str, StreamedGeneration] = {}
        self._write_lock = asyncio.Lock()  # one write in flight at a time on a call
        self._pending: set[asyncio.Future] = set()  # cancel writes under way (kept from the GC)
        self._error: grpc.aio.AioRpcError | None = None  # how the call ended, once it has
        self._reader = asyncio.ensure_future(self._read())
        self._accepted = asyncio.ensure_future(self._call.initial_metadata())

    async def start(self, request: stage_pb2.GenerateRequest, timeout_s: float) -> StreamedGeneration:
        # Write only once the stage has accepted the call: a write racing a call it already ended (a
        # stage that is not serving) makes grpc.aio report INTERNAL in place of the stage's status
        # (grpc/grpc#36066), and the client could not fail over.
        if not self._accepted.done():
            try:
                await asyncio.wait_for(asyncio.shield(self._accepted), timeout_s)
            except TimeoutError:
                raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded: the entry stage did not "
                                f"accept the call in {timeout_s:g} s") from None
        if self._error is not None:
            raise self._error
        if self._call.done():  # ended before this stream's reader saw it
            code = await self._call.code()
            if code == grpc.StatusCode.OK:  # a stopping stage ends its calls cleanly: it serves no more
                raise rpc_error(grpc.StatusCode.UNAVAILABLE, "the entry stage ended the generation stream")
            raise rpc_error(code, await self._call.details() or code.name)
        if request.request_id in self._generations:
            raise rpc_error(grpc.StatusCode.INVALID_ARGUMENT, f"request_id {request.request_id!r} is already running")
        generation = self._generations[request.request_id] = StreamedGeneration(self, request.request_id, timeout_s)
        try:
            await self._write(stage_pb2.GenerateStreamRequest(start=request))
        except Exception as exc:  # noqa: BLE001 - the call broke; its reader says how, to every generation
            log.debug("GenerateStream: writing a start failed: %r", exc)
            if self._error is not None:
                generation.fail(self._error)  # the reader ended before this generation joined
        return generation

    @property
    def closed(self) -> bool:
        return self._error is not None

    def send_cancel(self, request_id: str) -> None:
        self.forget(request_id)
        if self.closed:
            return
        task = asyncio.ensure_future(self._write_quietly(stage_pb2.GenerateStreamRequest(cancel=request_id)))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    def forget(self, request_id: str) -> None:
        self._generations.pop(request_id, None)

    def close(self) -> None:
        self._call.cancel()
        self._reader.cancel()
        self._accepted.cancel()

    async def _write(self, message: stage_pb2.GenerateStreamRequest) -> None:
        async with self._write_lock:
            await self._call.write(message)

    async def _write_quietly(self, message: stage_pb2.GenerateStreamRequest) -> None:
        try:
            await self._write(message)
        except Exception as exc:  # noqa: BLE001 - a cancel to a call that ended has nothing left to cancel
            log.debug("GenerateStream: writing a cancel failed: %r", exc)

    async def _read(self) -> None:
        error = rpc_error(grpc.StatusCode.UNAVAILABLE, "the entry stage ended the generation stream")
        try:
            async for message in self._call:
                for update in message.updates:
                    generation = self._generations.get(update.request_id)
                    if generation is not None:  # else it was cancelled or timed out: nobody waits for it
                        generation.deliver(update)
        except grpc.aio.AioRpcError as exc:
            error = exc
            if exc.code() == grpc.StatusCode.INTERNAL and "execute_batch" in (exc.debug_error_string() or ""):
                # grpc/grpc#36066: a write raced the stage ending the call, and grpc.aio replaced the
                # stage's status with INTERNAL. The call ended on the stage's side: say so, so requests
                # that got nothing yet fail over.
                error = rpc_error(grpc.StatusCode.UNAVAILABLE, f"the entry stage ended the generation stream "
                                                               f"({exc.details()})")
        except asyncio.CancelledError:
            error = rpc_error(grpc.StatusCode.CANCELLED, "the gateway closed the generation stream")
            raise
        finally:
            self._error = error
            for generation in list(self._generations.values()):
                generation.fail(error)
            self._generations.clear()
