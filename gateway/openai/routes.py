"""OpenAI's routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models[/{id}]``.

Contract: ``router(serving, server)`` is a FastAPI ``APIRouter`` over an ``OpenAIServing``; the generating
routes stream or not as the request says, and a client that leaves cancels its generation
(``gateway.http.cancellation``). ``/v1/models`` lists the one served model (its card: id, ``created`` when the
app was made, ``owned_by``, ``root``, ``max_model_len``); ``/v1/models/{id}`` is that card, or a 404 for
another name.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway.chat.plan import ChatServer
from gateway.http.cancellation import until_disconnect

from .schemas import ChatCompletionRequest, CompletionRequest
from .serving import OpenAIServing


def router(serving: OpenAIServing, server: ChatServer) -> APIRouter:
    routes = APIRouter()
    created = int(time.time())

    @routes.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await until_disconnect(request, serving.completions(body))

    @routes.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await until_disconnect(request, serving.chat(body))

    def model_card() -> dict[str, Any]:
        name = server.model
        return {"id": name, "object": "model", "created": created, "owned_by": "stagemesh", "root": name,
                "parent": None, "max_model_len": server.max_model_len}

    @routes.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @routes.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict[str, Any]:
        server.check_model(model_id or None)
        return model_card()

    return routes
