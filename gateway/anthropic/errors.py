"""Anthropic's error envelope on the Anthropic routes, whichever part of the gateway refused the request.

Contract:
- ``error_body(status, message)`` is Anthropic's envelope ``{"type": "error", "error": {"type", "message"}}``,
  its ``type`` chosen by status (``invalid_request_error``, ``rate_limit_error``, ``overloaded_error``, ...);
  ``event(err)`` is the same as a stream's ``error`` event.
- ``AnthropicErrorMiddleware(app, prefix)`` rewrites every JSON error response under ``prefix`` from the
  gateway's OpenAI envelope into Anthropic's, keeping its status and headers: a 401 from the key check, a
  429 from the limits, a 400 from validation and a 404 for the model all read alike to an Anthropic client.
  Streams (status 200) pass untouched.
- ``ERROR_SCHEMA`` is the envelope's JSON Schema (``/openapi.json``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from gateway.http.errors import APIError

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error",
          500: "api_error", 503: "overloaded_error", 504: "timeout_error"}
PREFIX = "/v1/messages"
ERROR_SCHEMA = {"type": "object", "required": ["type", "error"], "properties": {
    "type": {"const": "error"},
    "error": {"type": "object", "required": ["type", "message"], "properties": {
        "type": {"enum": sorted(set(_TYPES.values()))}, "message": {"type": "string"}}}}}


def error_type(status: int) -> str:
    return _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's envelope; its ``type`` is ``_TYPES``'s for the status, else ``api_error`` for a 5xx and
    ``invalid_request_error`` for a 4xx."""
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def event(err: APIError) -> dict[str, Any]:
    return error_body(err.status, err.message)


def _rewritten(status: int, body: bytes) -> bytes | None:
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    error = parsed.get("error") if isinstance(parsed, dict) else None
    if not isinstance(error, dict) or not isinstance(error.get("message"), str) or parsed.get("type") == "error":
        return None
    return json.dumps(error_body(status, error["message"])).encode()


class AnthropicErrorMiddleware:
    """Pure ASGI, added outside the key check and the limits so their errors are rewritten too.

    An error response keeps its status and headers (``Retry-After``, ``x-should-retry``); a body that is not
    the OpenAI envelope passes unchanged.
    """

    def __init__(self, app: Any, prefix: str = PREFIX) -> None:
        self.app = app
        self._prefix = prefix

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not (path == self._prefix or path.startswith(self._prefix + "/")):
            await self.app(scope, receive, send)
            return
        start: dict | None = None
        chunks: list[bytes] = []

        async def rewriting_send(message: dict) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                if message["status"] < 400:
                    await send(message)
                    return
                start = message  # held until the whole (small) error body is here
                return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            body = b"".join(chunks)
            new = _rewritten(start["status"], body)
            headers = list(start.get("headers", ()))
            if new is not None:
                body = new
                headers = [(k, v) for k, v in headers if k.lower() != b"content-length"]
                headers.append((b"content-length", str(len(body)).encode()))
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, rewriting_send)
