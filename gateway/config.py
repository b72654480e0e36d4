"""Gateway configuration: one frozen value, defaults that suit one Mac or a few.

Contract: ``GatewayConfig`` is everything ``gateway.app.create_app`` reads: the served model and its context
length, the API keys, the generation deadline, the caps on requests and body size, the gRPC channels' options,
TLS and mesh token, the origins browsers may call from, the chat requests' defaults
(``gateway.chat.defaults``), the served model's card and the port Ollama's clients reach it on. Its fields are
checked on construction (``ValueError`` / ``TypeError``), 0 means "no cap" for every cap, and ``mesh_token``
never shows in its repr.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.chat.defaults import OpenAIDefaults
from stagemesh_core.grpc_tls import TlsFiles
from stagemesh_core.model_card import ModelCard


@dataclass(frozen=True)
class GatewayConfig:
    """The gateway's settings.

    - ``served_model_name``: the only model name clients may ask for (an empty or absent ``model`` also
      means it).
    - ``max_model_len``: context length; a prompt plus ``max_tokens`` must fit.
    - ``api_keys``: accepted bearer keys for ``/v1/*``; empty: no auth.
    - ``request_timeout_s``: deadline of each generation on a stage (a request outliving it gets a 504, and
      the stage aborts the sequence).
    - ``max_outstanding_per_replica``: calls in flight per replica before new ones get 503 (0: no
      gateway-side cap; the entry stage's own queue still answers RESOURCE_EXHAUSTED when full).
    - ``failover_attempts``: other replicas tried when a call is refused (UNAVAILABLE / RESOURCE_EXHAUSTED)
      before its first token.
    - ``grpc_channel_options``: extra ``grpc.aio`` channel options.
    - ``allowed_origins``: origins browsers may call from (CORS); empty: none.
    - ``max_request_bytes``: longer request bodies get 413 (0: no limit).
    - ``max_concurrent_requests`` / ``max_concurrent_requests_per_key``: requests in flight (in all / per API
      key) beyond which new ones get 429 with ``Retry-After`` (0: no cap). See ``gateway.http.limits``.
    - ``grpc_tls``: the node's TLS files (``stagemesh_core.grpc_tls``) for mutual TLS to the stages; None:
      plaintext.
    - ``mesh_token``: sent as gRPC metadata on every call to a stage (``stagemesh_core.mesh_token``); never
      shown in the config's repr.
    - ``openai``: server-side defaults of every chat request (``gateway.chat.defaults``).
    - ``prefix_routing_block_size``: the stages' prefix-cache block size, so a request goes to the replica
      its prompt's prefix went to (``gateway.mesh.prefix_routing``); None (prefix caching off): by load.
    - ``model_card``: what the served model is (``stagemesh_core.model_card``), for Ollama's ``/api/tags``,
      ``/api/show`` and ``/api/ps``; the default card knows nothing but the name.
    - ``ollama_port``: the second port the app also listens on for Ollama's clients (``stagemesh serve
      --ollama-port``), where ``GET /`` answers "Ollama is running" as Ollama does; 0: none.
    """

    served_model_name: str
    max_model_len: int
    api_keys: tuple[str, ...] = ()
    request_timeout_s: float = 600.0
    max_outstanding_per_replica: int = 0
    failover_attempts: int = 1
    openai: OpenAIDefaults = field(default_factory=OpenAIDefaults)
    grpc_channel_options: tuple[tuple[str, Any], ...] = (
        # Notice a dead stage host within ~30 s even on an idle GenerateStream call: ping every 20 s
        # (the stage accepts one every 10 s: stage_worker.grpc_service.SERVER_OPTIONS), and keep pinging
        # while no data flows (gRPC's client stops after two pings without data by default).
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.http2.max_pings_without_data", 0),
        # A restarted stage comes back on the same port: reconnect within a second instead of gRPC's
        # default backoff (up to 120 s, 10 s after ~20 s down), during which every call to a replica
        # the mesh already reports healthy again fails fast with UNAVAILABLE (503s after recovery).
        ("grpc.initial_reconnect_backoff_ms", 250),
        ("grpc.max_reconnect_backoff_ms", 1_000),
    )
    mesh_token: str = field(default="", repr=False)
    allowed_origins: tuple[str, ...] = ()
    max_request_bytes: int = 8 * 1024 * 1024
    max_concurrent_requests: int = 0
    max_concurrent_requests_per_key: int = 0
    grpc_tls: TlsFiles | None = None
    prefix_routing_block_size: int | None = None
    model_card: ModelCard = field(default_factory=ModelCard)
    ollama_port: int = 0

    def __post_init__(self) -> None:
        if not self.served_model_name:
            raise ValueError("served_model_name must not be empty")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be positive, got {self.request_timeout_s}")
        if min(self.max_request_bytes, self.max_concurrent_requests, self.max_concurrent_requests_per_key) < 0:
            raise ValueError("max_request_bytes and the concurrent-request caps must be >= 0 (0: no limit)")
        if self.max_outstanding_per_replica < 0 or self.failover_attempts < 0:
            raise ValueError("max_outstanding_per_replica and failover_attempts must be >= 0")
        if not 0 <= self.ollama_port <= 65535:
            raise ValueError(f"ollama_port must be a TCP port (0: none), got {self.ollama_port}")
        if isinstance(self.api_keys, str):  # a bare string would be taken as one key per character
            raise TypeError("api_keys must be a tuple of strings, not a string")
