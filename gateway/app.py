"""The gateway's FastAPI app: the factory composing the APIs' routers over one chat core.

Contract: ``create_app(GatewayConfig(...), mesh=mesh_view, tokenizer=tok, eos_token_ids=frozenset({2}))``
builds the app: OpenAI's ``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models`` and vLLM's
``/tokenize`` / ``/detokenize`` / ``/version`` (``gateway.openai``), OpenAI's ``/v1/responses``
(``gateway.openai_responses``), Anthropic's ``/v1/messages`` (``gateway.anthropic``), Ollama's ``/api/*``
(``gateway.ollama``), all over one ``gateway.chat.core.ChatCore``, plus ``/health``, ``/mesh``, ``/metrics``
and the dashboard at ``/`` (``gateway.http.dashboard``; Ollama's "Ollama is running" on ``ollama_port``).
``/v1/*``, ``/api/*`` and ``/dashboard/live`` require a key when ``api_keys`` is set; CORS, the body limit and
the in-flight caps are ``gateway.http.limits``. Every error is an OpenAI envelope (``gateway.http.errors``),
Anthropic's on ``/v1/messages``, Ollama's on ``/api``. gRPC channels to the entry stages
(``gateway.mesh``) are opened lazily on the server's event loop and closed at shutdown.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, cast

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from gateway.anthropic import errors as anthropic_errors
from gateway.anthropic import routes as anthropic_routes
from gateway.anthropic.serving import AnthropicServing
from gateway.chat.core import ChatCore
from gateway.chat.plan import ChatServer
from gateway.http import errors
from gateway.http.auth import ApiKeyMiddleware
from gateway.http.dashboard import dashboard_router
from gateway.http.limits import RequestLimitsMiddleware, add_cors
from gateway.http.metrics import GatewayMetrics, RequestMetricsMiddleware
from gateway.http.openapi import install_openapi
from gateway.mesh.replica_client import ReplicaClient, ReplicaKey
from gateway.ollama import errors as ollama_errors
from gateway.ollama import routes as ollama_routes
from gateway.ollama.serving import OllamaServing
from gateway.openai import routes as openai_routes
from gateway.openai import tokenize
from gateway.openai.serving import OpenAIServing
from gateway.openai_responses import routes as responses_routes
from gateway.openai_responses.serving import ResponsesServing
from stagemesh_core.settings import stagemesh_version
from stagemesh_core.snapshots import MeshView

from .config import GatewayConfig

__all__ = ["GatewayConfig", "create_app"]


def create_app(config: GatewayConfig, *, mesh: MeshView, tokenizer: Any, eos_token_ids: frozenset[int]) -> FastAPI:
    """The app: the routers (``gateway.openai``'s, the tokenizer routes, ``/v1/messages`` and
    ``/v1/messages/count_tokens``, ``/v1/responses`` and ``/v1/responses/input_tokens``, the dashboard's
    ``GET /`` and ``GET /dashboard/live``) and its own ``GET /health`` (200 when at least one replica is
    healthy, else 503), ``GET /mesh`` (the coordinator's snapshot, ``MeshSnapshot.to_json()``) and
    ``GET /metrics`` (Prometheus, this app's own registry)."""
    client = ReplicaClient(
        mesh, request_timeout_s=config.request_timeout_s,
        max_outstanding_per_replica=config.max_outstanding_per_replica,
        failover_attempts=config.failover_attempts, channel_options=config.grpc_channel_options,
        mesh_token=config.mesh_token, tls=config.grpc_tls, prefix_block_size=config.prefix_routing_block_size,
    )

    def outstanding_by_replica() -> dict[int, int]:
        out: dict[int, int] = {}
        for key, count in client.balancer.snapshot().items():
            replica, _target = cast(ReplicaKey, key)  # the client keys its balancer by (replica, entry target)
            out[replica] = out.get(replica, 0) + count
        return out

    metrics = GatewayMetrics(mesh, outstanding_by_replica, lambda: client.failures, lambda: client.routed)
    server = ChatServer.create(config.served_model_name, config.max_model_len, tokenizer, eos_token_ids,
                               config.openai)
    core = ChatCore(server, client, metrics)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await client.close()

    app = FastAPI(title="stagemesh gateway", version=stagemesh_version(), lifespan=lifespan)
    app.state.config = config
    app.state.metrics = metrics
    app.state.replica_client = client
    errors.install_error_handlers(app)
    app.include_router(tokenize.router(server))  # /tokenize, /detokenize, /version
    app.include_router(openai_routes.router(OpenAIServing(core), server))

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

    app.include_router(anthropic_routes.router(AnthropicServing(core)))
    app.include_router(responses_routes.router(ResponsesServing(core)))
    app.include_router(ollama_routes.router(OllamaServing(core, config.model_card, mesh)))
    app.include_router(dashboard_router(mesh, metrics, outstanding_by_replica, config.api_keys))

    anthropic_envelope = ("AnthropicErrorResponse", anthropic_errors.ERROR_SCHEMA)
    install_openapi(app, vocab_size=server.vocab_size, max_model_len=config.max_model_len,
                    error_envelopes={anthropic_errors.PREFIX: anthropic_envelope})
    known = frozenset(path for path in _route_paths(app.routes) if "{" not in path)
    # Added innermost first. A request meets: metrics (counts every response, 401s too), CORS, Ollama's GET / on
    # its port, Ollama's and Anthropic's error envelopes, the key check, then the body and in-flight limits
    # (gateway.http.limits), so an unkeyed request takes no slot.
    app.add_middleware(RequestLimitsMiddleware, max_request_bytes=config.max_request_bytes,
                       max_in_flight=config.max_concurrent_requests,
                       max_in_flight_per_key=config.max_concurrent_requests_per_key)
    app.add_middleware(ApiKeyMiddleware, keys=config.api_keys)
    app.add_middleware(anthropic_errors.AnthropicErrorMiddleware)  # outside the key check and limits: their errors too
    app.add_middleware(ollama_errors.OllamaErrorMiddleware)  # the same, on /api
    app.add_middleware(ollama_routes.OllamaRootMiddleware, port=config.ollama_port)
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
