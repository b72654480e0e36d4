"""The Messages API's routes: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

Contract: ``router(serving)`` is a FastAPI ``APIRouter`` over an
``AnthropicServing``. Headers Anthropic's clients send (``anthropic-version``,
``anthropic-beta``) and the ``?beta=true`` query are accepted and change
nothing; the key is checked by ``gateway.http.auth`` (``x-api-key`` or a bearer
token), errors are Anthropic's envelope (``gateway.anthropic.errors``), and a
client that leaves cancels its generation (``gateway.http.cancellation``).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway.http.cancellation import until_disconnect

from .protocol import CountTokensRequest, MessagesRequest
from .serving import AnthropicServing


def router(serving: AnthropicServing) -> APIRouter:
    routes = APIRouter()

    @routes.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request) -> Response:
        return await until_disconnect(request, serving.messages(body))

    @routes.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest) -> dict[str, int]:
        return serving.count_tokens(body)

    return routes
