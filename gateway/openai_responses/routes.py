"""The Responses API's routes: ``POST /v1/responses`` and ``POST /v1/responses/input_tokens``.

Contract: ``router(serving)`` is a FastAPI ``APIRouter`` over a
``ResponsesServing``; the key, the limits and the error envelope are the
gateway's OpenAI ones, and a client that leaves cancels its generation
(``gateway.http.cancellation``). No route reads a stored response back: nothing is
stored.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway.http.cancellation import until_disconnect

from .protocol import InputTokensRequest, ResponsesRequest
from .serving import ResponsesServing


def router(serving: ResponsesServing) -> APIRouter:
    routes = APIRouter()

    @routes.post("/v1/responses")
    async def create(body: ResponsesRequest, request: Request) -> Response:
        return await until_disconnect(request, serving.create(body))

    @routes.post("/v1/responses/input_tokens")
    async def input_tokens(body: InputTokensRequest) -> dict[str, Any]:
        return serving.input_tokens(body)

    return routes
