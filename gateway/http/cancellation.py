"""Cancel a handler when its HTTP client goes away.

Contract: ``await until_disconnect(request, work)`` runs ``work`` and returns
its result, unless the client disconnects first: then ``work`` is cancelled
(its ``finally`` blocks cancel the gRPC calls, so the stages free the slots)
and a 499 response nobody will read is returned.

Why: a non-streaming completion may take minutes; without this the stage keeps
generating for a client that timed out. We wait on the ASGI ``receive`` for
``http.disconnect`` (the body has already been read by then), as vLLM's
``with_cancellation`` does; streaming responses get the same from Starlette's
``StreamingResponse``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import Response

T = TypeVar("T")


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, work: Awaitable[T]) -> T | Response:
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    return Response(status_code=499)
