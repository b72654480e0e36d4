"""The gateway's own limits: request body size, requests in flight, and CORS.

Contract:
- ``RequestLimitsMiddleware(app, max_request_bytes, max_in_flight, max_in_flight_per_key)`` is pure ASGI and
  guards ``POST`` under ``/v1`` and Ollama's ``/api`` (the routes that generate): a body longer than
  ``max_request_bytes`` gets 413 before any of it is parsed, and a request arriving while ``max_in_flight``
  requests are running (in all), or ``max_in_flight_per_key`` with the same API key, gets 429 with
  ``Retry-After`` and OpenAI's ``rate_limit_exceeded`` envelope (Ollama's shape on ``/api``). 0 means no cap.
  It sits inside the API-key check.
- ``add_cors(app, allowed_origins)``: Starlette's CORS middleware for exactly those origins (``"*"``
  allowed), none when empty. Add it outside the API-key check.
- ``InFlight`` is the counting, pure and synchronous (one event loop).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from .auth import GUARDED_PREFIXES, presented_key
from .errors import APIError

RETRY_AFTER_S = 1  # requests finish in seconds; a client told to wait one second rarely finds it still full


def too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than this server's limit of {limit} bytes "
                         "(--max-request-bytes); send a shorter prompt.", code="request_too_large")


def too_many(who: str, limit: int, flag: str) -> APIError:
    return APIError(429, f"Too many requests in flight: {who} already has {limit} running ({flag}); "
                         f"retry after {RETRY_AFTER_S} s.", code="rate_limit_exceeded", should_retry=True)


@dataclass
class InFlight:
    """Requests running, in all and per key; ``enter`` refuses (returns an error) when a cap is reached."""

    max_total: int = 0
    max_per_key: int = 0
    total: int = 0
    per_key: dict[str, int] = field(default_factory=dict)

    def enter(self, key: str) -> APIError | None:
        # The key's own cap first: when both are reached, that is the one its holder can act on.
        if self.max_per_key and self.per_key.get(key, 0) >= self.max_per_key:
            return too_many("this API key", self.max_per_key, "--max-concurrent-requests-per-key")
        if self.max_total and self.total >= self.max_total:
            return too_many("the server", self.max_total, "--max-concurrent-requests")
        self.total += 1
        self.per_key[key] = self.per_key.get(key, 0) + 1
        return None

    def leave(self, key: str) -> None:
        self.total -= 1
        left = self.per_key[key] - 1
        if left:
            self.per_key[key] = left
        else:
            del self.per_key[key]  # keys come and go; the map must not grow with every key ever seen


def _header(scope: dict, name: bytes) -> bytes:
    return next((v for k, v in scope.get("headers", ()) if k == name), b"")


def key_identity(scope: dict) -> str:
    """Who the request counts against: a digest of its key (never the key itself)."""
    token = presented_key(scope)
    return hashlib.sha256(token.encode("latin-1")).hexdigest()[:16] if token else "anonymous"


async def send_error(send: Callable, err: APIError, extra: Sequence[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               *((k.encode(), v.encode()) for k, v in err.headers().items()), *extra]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class RequestLimitsMiddleware:
    """The body limit and the in-flight caps on the generating routes.

    A body too long gets its 413 at once from ``Content-Length``, or as soon as a chunked body passes the
    limit: the body is read here, up to the limit, and replayed to the app (later ``receive`` calls still
    report the client's disconnect). A request holds its in-flight slot until its response (a whole stream)
    has ended or the client has gone. Inside the API-key check, a request with no valid key never takes a
    slot; without keys every client shares one "key" and the per-key cap acts as a second global cap.
    """

    def __init__(self, app: Any, *, max_request_bytes: int = 0, max_in_flight: int = 0,
                 max_in_flight_per_key: int = 0) -> None:
        self.app = app
        self._max_bytes = max_request_bytes
        self.in_flight = InFlight(max_in_flight, max_in_flight_per_key)

    def _guarded(self, scope: dict) -> bool:
        path = scope.get("path", "")
        return (scope["type"] == "http" and scope.get("method") == "POST"
                and any(path == prefix or path.startswith(prefix + "/") for prefix in GUARDED_PREFIXES))

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if not self._guarded(scope):
            await self.app(scope, receive, send)
            return
        if self._max_bytes:
            declared = _header(scope, b"content-length")
            if declared.isdigit() and int(declared) > self._max_bytes:
                await send_error(send, too_large(self._max_bytes), [(b"connection", b"close")])
                return
            buffered = await self._read_body(receive)
            if buffered is None:
                await send_error(send, too_large(self._max_bytes), [(b"connection", b"close")])
                return
            receive = _replay(buffered, receive)
        key = key_identity(scope)
        refused = self.in_flight.enter(key)
        if refused is not None:
            await send_error(send, refused, [(b"retry-after", str(RETRY_AFTER_S).encode())])
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight.leave(key)

    async def _read_body(self, receive: Callable) -> list[dict] | None:
        """The body's messages, or None once they pass the limit (what was read is dropped)."""
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                return messages  # the client left; the app will see the disconnect
            size += len(message.get("body", b""))
            if size > self._max_bytes:
                return None
            if not message.get("more_body", False):
                return messages


def _replay(messages: list[dict], receive: Callable) -> Callable:
    pending = list(messages)

    async def replay() -> dict:
        return pending.pop(0) if pending else await receive()

    return replay


def add_cors(app: FastAPI, allowed_origins: Sequence[str]) -> None:
    """CORS for ``allowed_origins`` only: browsers on other origins are refused by default. Added outside the
    API-key check, so a refused request still carries the CORS headers its page needs to read the 401."""
    if not allowed_origins:
        return
    app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST", "OPTIONS"],
                       allow_headers=["*"],  # the OpenAI JS SDK sends many x-stainless-* headers
                       expose_headers=["retry-after", "x-request-id"], max_age=600)
