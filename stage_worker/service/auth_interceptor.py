"""The one check between a stage's gRPC port and its handlers: the mesh token.

Contract: ``MeshTokenInterceptor(token)`` is a ``grpc.aio.ServerInterceptor`` (the
stage's server is grpc.aio, ``stage_worker.service.grpc_service``). A call
to a method that ``stagemesh_core.mesh_token.requires_token`` names (every
method but health, reflection and ``GetStageInfo``; default deny, so a method
added later is guarded without touching this file) goes to its handler only
when its metadata carries the token; otherwise it ends ``UNAUTHENTICATED``
before the handler runs, with a message that says what to send but never the
token. Refusals are logged with the peer's address only.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from stagemesh_core.mesh_token import METADATA_KEY, requires_token, token_matches

log = logging.getLogger(__name__)

REFUSAL = (f"this stage requires the mesh token: send gRPC metadata '{METADATA_KEY}: Bearer <token>' "
           "(the token given to `stagemesh serve --mesh-token` or STAGEMESH_MESH_TOKEN)")


def _refusing_handler(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that ends the call UNAUTHENTICATED."""

    async def refuse(_request: Any, context: grpc.aio.ServicerContext) -> Any:
        log.warning("refused %s from %s: no valid mesh token", method, context.peer())
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)

    deserialize, serialize = handler.request_deserializer, handler.response_serializer
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse, deserialize, serialize)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, deserialize, serialize)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse, deserialize, serialize)
    return grpc.unary_unary_rpc_method_handler(refuse, deserialize, serialize)


class MeshTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("a stage needs a mesh token to guard its gRPC methods")
        self._token = token

    def __repr__(self) -> str:  # never the token
        return "MeshTokenInterceptor()"

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not requires_token(method):
            return handler  # unknown methods stay UNIMPLEMENTED; open ones need nothing
        metadata = handler_call_details.invocation_metadata or ()
        if token_matches(metadata, self._token):
            return handler
        return _refusing_handler(handler, method)
