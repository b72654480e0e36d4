"""The gateway's FastAPI app: the factory and its routes, nothing else.

Contract: ``create_app(GatewayConfig(...), mesh=mesh_view, tokenizer=tok, eos_token_ids=frozenset({2}))``
builds the app: OpenAI's ``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses``
(``gateway.openai_responses``) and ``/v1/models``, Anthropic's ``/v1/messages`` (``gateway.anthropic``), the
last two run through the chat endpoint's checks and generation, ``/health``, ``/mesh``, ``/metrics``, vLLM's
``/tokenize`` / ``/detokenize`` / ``/version`` (``gateway.tokenize_routes``) and the dashboard at ``/``
(``gateway.dashboard``). ``/v1/*`` and ``/dashboard/live`` require a key when ``api_keys`` is set; CORS, the
body limit and the in-flight caps are ``gateway.limits``. Every error is an OpenAI envelope
(``gateway.errors``), Anthropic's on ``/v1/messages``. gRPC channels to the entry stages are opened lazily on
the server's event loop and closed at shutdown.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, cast

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from gateway.anthropic.errors import AnthropicErrorMiddleware
from gateway.anthropic.serving import AnthropicServing
from gateway.chat.request import ChatCompletionRequest, CompletionRequest
from gateway.http.auth import ApiKeyMiddleware
from gateway.http.cancellation import until_disconnect
from gateway.http.dashboard import dashboard_router
from gateway.http.limits import RequestLimitsMiddleware, add_cors
from gateway.http.metrics import GatewayMetrics, RequestMetricsMiddleware
from gateway.http.openapi import install_openapi
from gateway.mesh.replica_client import ReplicaClient, ReplicaKey
from gateway.openai.serving import OpenAIServing
from gateway.openai.tokenize import router as tokenize_router
from gateway.openai_responses.serving import ResponsesServing
from stagemesh_core.settings import stagemesh_version
from stagemesh_core.snapshots import MeshView

from .anthropic import errors as anthropic_errors
from .anthropic import routes as anthropic_routes
from .config import GatewayConfig
from .http import errors
from .openai_responses import routes as responses_routes

__all__ = ["GatewayConfig", "create_app"]


def create_app(config: GatewayConfig, *, mesh: MeshView, tokenizer: Any, eos_token_ids: frozenset[int]) -> FastAPI:
    """The app, its routes besides the routers': ``POST /v1/completions`` and ``POST /v1/chat/completions``
    (streaming and not), ``GET /v1/models`` and ``/v1/models/{id}``, ``GET /health`` (200 when at least one
    replica is healthy, else 503), ``GET /mesh`` (the coordinator's snapshot, ``MeshSnapshot.to_json()``) and
    ``GET /metrics`` (Prometheus, this app's own registry). The routers add ``/v1/messages`` (and
    ``/v1/messages/count_tokens``), ``/v1/responses`` (and ``/v1/responses/input_tokens``), the tokenizer
    routes and the dashboard's ``GET /`` and ``GET /dashboard/live``."""
    client = ReplicaClient(
        mesh, request_timeout_s=config.request_timeout_s,
        max_outstanding_per_replica=config.max_outstanding_per_replica,
        failover_attempts=config.failover_attempts, channel_options=config.grpc_channel_options,
        mesh_token=config.mesh_token, tls=config.grpc_tls,
    )

    def outstanding_by_replica() -> dict[int, int]:
        out: dict[int, int] = {}
        for key, count in client.balancer.snapshot().items():
            replica, _target = cast(ReplicaKey, key)  # the client keys its balancer by (replica, entry target)
            out[replica] = out.get(replica, 0) + count
        return out

    metrics = GatewayMetrics(mesh, outstanding_by_replica, lambda: client.failures)
    serving = OpenAIServing(config, client, tokenizer, eos_token_ids, metrics)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await client.close()

    app = FastAPI(title="stagemesh gateway", version=stagemesh_version(), lifespan=lifespan)
    app.state.config = config
    app.state.metrics = metrics
    app.state.replica_client = client
    errors.install_error_handlers(app)
    app.include_router(tokenize_router(tokenizer, config))  # /tokenize, /detokenize, /version

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await until_disconnect(request, serving.completions(body))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await until_disconnect(request, serving.chat(body))

    def model_card() -> dict[str, Any]:
        name = config.served_model_name
        return {"id": name, "object": "model", "created": created, "owned_by": "stagemesh", "root": name,
                "parent": None, "max_model_len": config.max_model_len}

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict[str, Any]:
        serving.check_model(model_id or None)
        return model_card()

    @app.get("/health")
    async def health() -> JSONResponse:
        snapshot = mesh.snapshot()
        healthy = len(snapshot.healthy_replicas)
        if not healthy:
            return errors.no_healthy_replica().response()
        return JSONResponse({"status": "ok", "healthy_replicas": healthy, "replicas": len(snapshot.replicas)})

    @app.get("/mesh")
    async def mesh_json() -> dict[str, Any]:
        return mesh.snapshot().to_json()

    @app.get("/metrics")
    async def metrics_text() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    app.include_router(anthropic_routes.router(AnthropicServing(serving)))
    app.include_router(responses_routes.router(ResponsesServing(serving)))
    app.include_router(dashboard_router(mesh, metrics, outstanding_by_replica, config.api_keys))

    anthropic_envelope = ("AnthropicErrorResponse", anthropic_errors.ERROR_SCHEMA)
    install_openapi(app, vocab_size=len(tokenizer), max_model_len=config.max_model_len,
                    error_envelopes={anthropic_errors.PREFIX: anthropic_envelope})
    known = frozenset(path for path in _route_paths(app.routes) if "{" not in path)
    # Added innermost first. A request meets: metrics (counts every response, 401s too), CORS, Anthropic's error
    # envelope, the key check, then the body and in-flight limits (gateway.limits), so an unkeyed request takes
    # no slot.
    app.add_middleware(RequestLimitsMiddleware, max_request_bytes=config.max_request_bytes,
                       max_in_flight=config.max_concurrent_requests,
                       max_in_flight_per_key=config.max_concurrent_requests_per_key)
    app.add_middleware(ApiKeyMiddleware, keys=config.api_keys)
    app.add_middleware(AnthropicErrorMiddleware)  # outside the key check and limits: their errors too
    add_cors(app, config.allowed_origins)
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics, known_paths=lambda: known)
    return app


def _route_paths(routes: list[Any]) -> set[str]:
    """Every route's path, those of included routers too (FastAPI keeps an included router as one entry)."""
    paths: set[str] = set()
    for route in routes:
        if isinstance(getattr(route, "path", None), str):
            paths.add(route.path)
        included = getattr(route, "original_router", None)
        if included is not None:
            paths |= _route_paths(included.routes)
    return paths
