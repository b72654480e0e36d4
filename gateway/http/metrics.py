"""Prometheus metrics of one gateway app, in its own registry.

Contract:
- ``GatewayMetrics(mesh, outstanding, failures, routed)`` owns a private ``CollectorRegistry`` (several apps can live in
  one process, e.g. tests) holding the request-level ``stagemesh_gateway_*`` series and a ``StageCollector``
  (per-stage ``stagemesh_stage_*`` series from ``mesh.snapshot()``, read at scrape time); ``render()`` is the
  ``GET /metrics`` body. It is the ``TokenObserver`` of ``gateway.chat.generation``.
- The same TTFT and inter-token observations also go to ``recent_ttft``, ``recent_itl`` and the serving
  replica's pair in ``recent_by_replica`` (``gateway.http.recent.RecentWindow``): the last minute, for the
  dashboard's live percentiles.
- ``RequestMetricsMiddleware`` (pure ASGI) counts every response by route and status and times the generation
  endpoints end to end, including the stream.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from stagemesh_core.snapshots import MeshView

from .recent import RecentWindow

# vLLM's buckets, so dashboards built for it read ours alike.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses",
                              "/api/chat", "/api/generate"})


class StageCollector(Collector):
    """Per-stage series from the coordinator's latest snapshot, read at scrape time.

    Labelled ``replica``, ``rank``, ``worker`` (its place in a tensor-parallel group; 0 at -tp 1), ``host``:
    ``stagemesh_stage_{compute,wait,send}_seconds_total``,
    ``stagemesh_stage_batches_total``, ``stagemesh_stage_tokens_total``,
    ``stagemesh_stage_generated_tokens_total``, ``stagemesh_stage_running_sequences``,
    ``stagemesh_stage_waiting_requests``, ``stagemesh_stage_kv_tokens``, ``stagemesh_stage_kv_token_capacity``,
    ``stagemesh_stage_prefix_cache_{queries,hits,evictions}_total`` (tokens, tokens, blocks),
    ``stagemesh_stage_prefix_cache_blocks``,
    ``stagemesh_stage_spec_decode_num_{drafts,draft_tokens,accepted_tokens}_total`` and
    ``stagemesh_stage_spec_decode_num_accepted_tokens_per_pos_total{position}`` (vLLM's speculative decoding
    counters, on the entry stage), ``stagemesh_stage_healthy``; plus
    ``stagemesh_gateway_replica_outstanding_requests{replica}`` from the balancer and
    ``stagemesh_gateway_replica_failures_total{replica}`` (generations that failed on the replica, from the
    replica client) and ``stagemesh_gateway_routed_requests_total{replica,policy}`` (how each was routed).
    """

    def __init__(self, mesh: MeshView, outstanding: Callable[[], Mapping[int, int]],
                 failures: Callable[[], Mapping[int, int]] = dict,
                 routed: Callable[[], Mapping[tuple[int, str], int]] = dict) -> None:
        self._mesh = mesh
        self._outstanding = outstanding
        self._failures = failures
        self._routed = routed

    def collect(self) -> Iterable[Metric]:
        labels = ["replica", "rank", "worker", "host"]
        counters = {
            name: CounterMetricFamily(f"stagemesh_stage_{name}", doc, labels=labels)
            for name, doc in (
                ("compute_seconds", "Seconds the stage spent computing its layers"),
                ("wait_seconds", "Seconds the stage waited for input from its predecessor"),
                ("send_seconds", "Seconds the stage spent handing results to its successor"),
                ("batches", "Batches the stage computed"),
                ("tokens", "Token rows the stage computed"),
                ("generated_tokens", "Tokens the entry stage sampled for requests"),
                ("prefix_cache_queries", "Prompt tokens of new sequences (as vLLM's prefix_cache_queries)"),
                ("prefix_cache_hits", "Prompt tokens copied from the prefix cache (as vLLM's prefix_cache_hits)"),
                ("prefix_cache_evictions", "Blocks the stage dropped from its prefix cache"),
                ("spec_decode_num_drafts", "Verifications of proposed tokens (as vLLM's spec_decode_num_drafts)"),
                ("spec_decode_num_draft_tokens", "Tokens proposed for verification (as vLLM's)"),
                ("spec_decode_num_accepted_tokens", "Proposed tokens the model agreed with (as vLLM's)"),
            )
        }
        per_position = CounterMetricFamily("stagemesh_stage_spec_decode_num_accepted_tokens_per_pos",
                                           "Verifications whose proposal at this position was accepted (as vLLM's)",
                                           labels=[*labels, "position"])
        gauges = {
            name: GaugeMetricFamily(f"stagemesh_stage_{name}", doc, labels=labels)
            for name, doc in (
                ("running_sequences", "Sequences holding KV cache on the stage"),
                ("waiting_requests", "Requests queued on the entry stage"),
                ("kv_tokens", "Token positions of KV cache the stage holds"),
                ("kv_token_capacity", "Token positions of KV cache the stage's memory budget allows"),
                ("prefix_cache_blocks", "Blocks of KV the stage keeps in its prefix cache"),
            )
        }
        healthy = GaugeMetricFamily("stagemesh_stage_healthy", "1 when the stage is healthy", labels=labels)
        snapshot = self._mesh.snapshot()
        for replica in snapshot.replicas:
            for stage in replica.stages:
                values = [str(replica.replica), str(stage.rank), str(stage.member), stage.host]
                for name, family in counters.items():
                    family.add_metric(values, float(getattr(stage.stats, name)))
                for name, gauge in gauges.items():
                    gauge.add_metric(values, float(getattr(stage.stats, name)))
                for position, count in enumerate(stage.stats.spec_decode_num_accepted_tokens_per_pos):
                    per_position.add_metric([*values, str(position)], float(count))
                healthy.add_metric(values, 1.0 if stage.healthy else 0.0)
        outstanding = GaugeMetricFamily("stagemesh_gateway_replica_outstanding_requests",
                                        "Generations in flight from this gateway, per replica", labels=["replica"])
        for replica_id, count in sorted(self._outstanding().items()):
            outstanding.add_metric([str(replica_id)], float(count))
        failures = CounterMetricFamily("stagemesh_gateway_replica_failures",
                                       "Generations from this gateway that failed on the replica",
                                       labels=["replica"])
        for replica_id, count in sorted(self._failures().items()):
            failures.add_metric([str(replica_id)], float(count))
        routed = CounterMetricFamily("stagemesh_gateway_routed_requests",
                                     "Generations this gateway routed to the replica, by the policy that chose it "
                                     "(key: the client's cache key; prefix: where the prompt's prefix went; load)",
                                     labels=["replica", "policy"])
        for (replica_id, policy), count in sorted(self._routed().items()):
            routed.add_metric([str(replica_id), policy], float(count))
        yield from counters.values()
        yield from gauges.values()
        yield per_position
        yield healthy
        yield outstanding
        yield failures
        yield routed


class GatewayMetrics:
    """The gateway's series: ``stagemesh_gateway_requests_total{endpoint,status}``,
    ``..._time_to_first_token_seconds``, ``..._inter_token_latency_seconds``,
    ``..._e2e_request_latency_seconds`` (histograms), ``..._prompt_tokens_total``,
    ``..._generation_tokens_total`` (counters) and ``..._requests_running`` (gauge)."""

    def __init__(self, mesh: MeshView, outstanding: Callable[[], Mapping[int, int]],
                 failures: Callable[[], Mapping[int, int]] = dict,
                 routed: Callable[[], Mapping[tuple[int, str], int]] = dict) -> None:
        self.replica_failures = failures
        self.replica_routed = routed
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.requests = Counter("stagemesh_gateway_requests", "HTTP responses by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.ttft = Histogram("stagemesh_gateway_time_to_first_token_seconds", "Time to the first generated token",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("stagemesh_gateway_inter_token_latency_seconds", "Time between generated tokens",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("stagemesh_gateway_e2e_request_latency_seconds",
                             "Generation request latency, arrival to last byte", buckets=_E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter("stagemesh_gateway_prompt_tokens", "Prompt tokens sent to stages", registry=r)
        self.generation_tokens = Counter("stagemesh_gateway_generation_tokens", "Tokens generated", registry=r)
        self.running = Gauge("stagemesh_gateway_requests_running", "Generation requests in flight", registry=r)
        r.register(StageCollector(mesh, outstanding, failures, routed))
        self.recent_ttft = RecentWindow()
        self.recent_itl = RecentWindow()
        self.recent_by_replica: dict[int, tuple[RecentWindow, RecentWindow]] = {}  # replica -> (TTFT, ITL)

    def _replica_windows(self, replica: int) -> tuple[RecentWindow, RecentWindow]:
        windows = self.recent_by_replica.get(replica)
        if windows is None:
            windows = self.recent_by_replica[replica] = (RecentWindow(), RecentWindow())
        return windows

    # TokenObserver (gateway.chat.generation)
    def first_token(self, seconds: float, replica: int | None = None) -> None:
        self.ttft.observe(seconds)
        self.recent_ttft.add(seconds)
        if replica is not None:
            self._replica_windows(replica)[0].add(seconds)

    def inter_token(self, seconds: float, count: int, replica: int | None = None) -> None:
        for _ in range(count):
            self.itl.observe(seconds)
        self.recent_itl.add(seconds, count)
        if replica is not None:
            self._replica_windows(replica)[1].add(seconds, count)

    def usage(self, prompt_tokens: int, generation_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generation_tokens)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RequestMetricsMiddleware:
    """Pure ASGI, so it never breaks disconnect detection or streaming."""

    def __init__(self, app: Any, metrics: GatewayMetrics, known_paths: Callable[[], frozenset[str]]) -> None:
        self.app = app
        self.metrics = metrics
        self.known_paths = known_paths

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in self.known_paths() else "other"  # bounded label values
        generation = path in GENERATION_PATHS
        status = 500  # if the app dies before answering, that is what the client sees
        started = time.monotonic()

        async def send_wrapper(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        if generation:
            self.metrics.running.inc()
        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            if generation:
                self.metrics.running.dec()
                if status < 400:
                    self.metrics.e2e.observe(time.monotonic() - started)
            self.metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()
