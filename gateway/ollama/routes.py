"""Ollama's routes under ``/api/``, and its ``GET /`` on the port Ollama's clients reach.

Contract: ``router(serving)`` is a FastAPI ``APIRouter`` over an ``OllamaServing``: ``GET|HEAD /api/version``,
``GET|HEAD /api/tags``, ``POST /api/show``, ``GET /api/ps``, ``POST /api/chat`` and ``POST /api/generate``
(bodies read whatever their Content-Type, as Ollama reads them), and the model-management and embedding routes
(``/api/pull``, ``/api/push``, ``/api/create``, ``/api/blobs/...``, ``/api/copy``, ``DELETE /api/delete``,
``/api/embed``, ``/api/embeddings``) refused with 501 and what stagemesh does instead. The key is checked by
``gateway.http.auth`` as on ``/v1``; errors are Ollama's shape (``gateway.ollama.errors``); a client that
leaves cancels its generation. The routes are left out of ``/openapi.json``: Ollama's API is described by
Ollama's documentation and docs/api.md. ``OllamaRootMiddleware(app, port)`` answers ``GET`` / ``HEAD /`` on
that port with Ollama's "Ollama is running" (the dashboard keeps ``/`` on the gateway's own port).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from gateway.http.cancellation import until_disconnect
from gateway.http.errors import APIError, validation_error

from .protocol import ChatBody, GenerateBody, ShowBody, parse
from .serving import OllamaServing

M = TypeVar("M", bound=BaseModel)
RUNNING = b"Ollama is running"
_CHOSEN_AT_SERVE = ("the model is chosen when `stagemesh serve MODEL` starts (a GGUF file, an MLX or Hugging Face "
                    "directory, or a cached Hugging Face repo id)")
REFUSED: dict[tuple[str, str], str] = {
    ("POST", "/api/pull"): f"stagemesh pulls no models: {_CHOSEN_AT_SERVE}.",
    ("POST", "/api/push"): "stagemesh pushes no models: it serves the checkpoint `stagemesh serve` was given.",
    ("POST", "/api/create"): "stagemesh creates no models from a Modelfile: serve the checkpoint with `stagemesh serve "
                             "MODEL`; --chat-template and --generation-config set its template and defaults.",
    ("POST", "/api/blobs/{digest}"): "stagemesh stores no blobs: it creates no models (serve the checkpoint with "
                                     "`stagemesh serve MODEL`).",
    ("HEAD", "/api/blobs/{digest}"): "stagemesh stores no blobs.",
    ("POST", "/api/copy"): "stagemesh serves one model under one name: --served-model-name sets it.",
    ("DELETE", "/api/delete"): "stagemesh deletes no models: stop `stagemesh serve` to stop serving one.",
    ("POST", "/api/embed"): "stagemesh serves a generative model and computes no embeddings.",
    ("POST", "/api/embeddings"): "stagemesh serves a generative model and computes no embeddings.",
}


async def _body(request: Request, model: type[M]) -> M:
    try:
        return parse(await request.body(), model)
    except ValidationError as e:  # worded as every other body's (param: the first field)
        raise validation_error(RequestValidationError(e.errors()), request) from None


def _refusal(message: str) -> Callable[[], Any]:
    async def refuse() -> None:
        raise APIError(501, message, code="not_implemented")

    return refuse


def router(serving: OllamaServing) -> APIRouter:
    routes = APIRouter(include_in_schema=False)

    @routes.api_route("/api/version", methods=["GET", "HEAD"])
    async def version() -> dict[str, str]:
        return serving.version()

    @routes.api_route("/api/tags", methods=["GET", "HEAD"])
    async def tags() -> dict[str, Any]:
        return serving.tags()

    @routes.post("/api/show")
    async def show(request: Request) -> dict[str, Any]:
        return serving.show(await _body(request, ShowBody))

    @routes.get("/api/ps")
    async def ps() -> dict[str, Any]:
        return serving.ps()

    @routes.post("/api/chat")
    async def chat(request: Request) -> Response:
        body = await _body(request, ChatBody)
        return await until_disconnect(request, serving.chat(body))

    @routes.post("/api/generate")
    async def generate(request: Request) -> Response:
        body = await _body(request, GenerateBody)
        return await until_disconnect(request, serving.generate(body))

    for (method, path), message in REFUSED.items():
        routes.add_api_route(path, _refusal(message), methods=[method])
    return routes


class OllamaRootMiddleware:
    """Pure ASGI: ``GET`` and ``HEAD /`` on ``port`` (the listener ``stagemesh serve --ollama-port`` adds) are
    Ollama's liveness answer, 200 ``text/plain`` "Ollama is running", which clients probe before anything else.
    Every other request, and ``/`` on any other port, goes on to the app."""

    def __init__(self, app: Any, port: int) -> None:
        self.app = app
        self._port = port

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        server = scope.get("server") or (None, None)
        if (scope["type"] != "http" or scope.get("path") != "/" or scope.get("method") not in ("GET", "HEAD")
                or not self._port or server[1] != self._port):
            await self.app(scope, receive, send)
            return
        body = b"" if scope["method"] == "HEAD" else RUNNING
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/plain; charset=utf-8"), (b"content-length", str(len(RUNNING)).encode())]})
        await send({"type": "http.response.body", "body": body})

