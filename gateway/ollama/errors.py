"""Ollama's error shape on ``/api/``, whichever part of the gateway refused the request.

Contract: ``OllamaErrorMiddleware(app, prefix="/api")`` rewrites every JSON error response under ``prefix``
from the gateway's OpenAI envelope (``{"error": {"message", ...}}``) into Ollama's ``{"error": "<message>"}``,
keeping its status and headers: a 401 from the key check, a 413 or 429 from the limits, a 400 from validation
or a malformed body, a 404 for a model or a route all read alike to an Ollama client. Responses below 400
(streams included) pass untouched; a stream's own failure is already an ``{"error": ...}`` line.
``ollama_error(message)`` is the shape itself.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

PREFIX = "/api"


def ollama_error(message: str) -> dict[str, str]:
    return {"error": message}


def _rewritten(body: bytes) -> bytes | None:
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    error = parsed.get("error") if isinstance(parsed, dict) else None
    if not isinstance(error, dict) or not isinstance(error.get("message"), str):
        return None  # not the OpenAI envelope (already Ollama's, or another body): left as it is
    return json.dumps(ollama_error(error["message"])).encode()


class OllamaErrorMiddleware:
    """Pure ASGI, added outside the key check and the limits so their errors are rewritten too (the same
    placement as Anthropic's envelope on ``/v1/messages``)."""

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
            new = _rewritten(body)
            headers = list(start.get("headers", ()))
            if new is not None:
                body = new
                headers = [(k, v) for k, v in headers if k.lower() != b"content-length"]
                headers.append((b"content-length", str(len(body)).encode()))
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, rewriting_send)
