"""API-key check for the API routes.

Contract: ``ApiKeyMiddleware(app, keys)`` is pure ASGI. With no keys it is a
no-op. Otherwise every HTTP request under ``/v1`` or Ollama's ``/api`` (except
CORS preflight OPTIONS) must carry ``Authorization: Bearer <key>`` (scheme
case-insensitive) or ``x-api-key: <key>`` (Anthropic's clients send that)
matching one of the keys, or it gets a 401 OpenAI envelope (Anthropic's and
Ollama's on their routes). ``/health``, ``/metrics`` and ``/mesh`` stay open so
probes and scrapers need no secret, and so does Ollama's ``GET /``.
Keys are compared as sha256 digests with ``secrets.compare_digest`` so the
time taken does not leak how much of a key matched.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Callable, Iterable
from typing import Any

from .errors import unauthorized

# Ollama's clients send the key as a bearer token too (OLLAMA_API_KEY, Open WebUI's connection key).
GUARDED_PREFIXES = ("/v1", "/api")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def presented_key(scope: dict) -> str:
    """The key a request carries: its bearer token, else its ``x-api-key``; "" when none."""
    headers = dict(scope.get("headers", ()))
    scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").strip().partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return headers.get(b"x-api-key", b"").decode("latin-1").strip()


class ApiKeyMiddleware:
    def __init__(self, app: Any, keys: Iterable[str]) -> None:
        self.app = app
        self._digests = tuple(_digest(k) for k in keys if k)

    def _guarded(self, scope: dict) -> bool:
        path = scope.get("path", "")
        return (scope["type"] == "http" and scope.get("method") != "OPTIONS"
                and any(path == prefix or path.startswith(prefix + "/") for prefix in GUARDED_PREFIXES))

    def _authorized(self, scope: dict) -> bool:
        token = presented_key(scope)
        if not token:
            return False
        got = _digest(token)
        ok = False
        for digest in self._digests:  # no early exit: constant work whichever key matches
            ok |= secrets.compare_digest(got, digest)
        return ok

    def allows(self, scope: dict) -> bool:
        """Whether a request may pass whatever its path: no keys are set, or it carries one of them."""
        return not self._digests or self._authorized(scope)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if not self._digests or not self._guarded(scope) or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        err = unauthorized()
        body = json.dumps(err.body()).encode()
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
