"""Server-sent events: how every API's stream is framed and sent.

Contract: ``sse(data, event=None)`` frames one event (``event: <name>`` when named, then ``data:`` with the
compact JSON, non-ASCII kept). ``stream_response(events)`` is the HTTP response of a stream: an
``SSEResponse`` (``text/event-stream``, no caching, no proxy buffering) whose iterator is closed however the
response ends, so a client that leaves cancels the generation behind it. ``new_id(prefix)`` is a fresh
object id (``msg_...``, ``resp_...``).
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

# no-cache / no buffering: proxies must pass each event on at once.
STREAM_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def sse(data: dict[str, Any], event: str | None = None) -> str:
    named = f"event: {event}\n" if event is not None else ""
    return f"{named}data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class SSEResponse(StreamingResponse):
    """A stream whose iterator is always closed, whichever way the response ends."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with contextlib.suppress(BaseException):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]


def stream_response(events: AsyncIterator[str]) -> SSEResponse:
    return SSEResponse(events, headers=STREAM_HEADERS)
