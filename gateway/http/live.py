"""The dashboard's live document: the mesh snapshot and the gateway's counters, with rates.

Contract:
- ``LiveSampler(metrics)``: ``document(snapshot, outstanding, auth_required=...)`` is the JSON of
  ``GET /dashboard/live`` (docs/api.md, "Live mesh data (dashboard)").
- ``stage_rates`` and ``build_document`` are pure functions over plain values.
Nothing here keeps books of its own: every figure comes from the coordinator's ``MeshSnapshot`` (what
``GET /mesh`` returns) or the gateway's ``GatewayMetrics`` (what ``GET /metrics`` exports), and rates are
differences of their counters between two samples a few seconds apart.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from stagemesh_core.snapshots import MeshSnapshot, StageSnapshot, StageStats

from .metrics import GENERATION_PATHS, GatewayMetrics

RATE_WINDOW_S = 5.0  # rates over about the last five seconds: live, yet not one noisy second
ERROR_WINDOW_S = 60.0  # errors "in the last minute", like the latency percentiles


@dataclass(frozen=True)
class GatewayCounters:
    """The gateway's own figures at one moment, read from its Prometheus metrics."""

    requests: int  # generation responses so far
    client_errors: int  # generation responses with a 4xx status
    server_errors: int  # generation responses with a 5xx status
    running: int  # generation requests in flight
    replica_failures: Mapping[int, int]  # replica -> generations that failed there
    replica_routed: Mapping[tuple[int, str], int] = field(default_factory=dict)  # (replica, policy) -> routed

    @classmethod
    def read(cls, metrics: GatewayMetrics) -> GatewayCounters:
        requests = client = server = 0
        for family in metrics.requests.collect():
            for sample in family.samples:
                if not sample.name.endswith("_total") or sample.labels.get("endpoint") not in GENERATION_PATHS:
                    continue
                status, count = int(sample.labels.get("status", "0")), int(sample.value)
                requests += count
                client += count if 400 <= status < 500 else 0
                server += count if status >= 500 else 0
        running = sum(int(s.value) for family in metrics.running.collect() for s in family.samples)
        return cls(requests, client, server, running, dict(metrics.replica_failures()),
                   dict(metrics.replica_routed()))


StageKey = tuple[int, int, int | None]  # (replica, rank, pid): a new process starts its counters at zero


def _stages(snapshot: MeshSnapshot) -> dict[StageKey, StageSnapshot]:
    return {(r.replica, s.rank, s.pid): s for r in snapshot.replicas for s in r.stages}


def stage_rates(before: StageStats, after: StageStats, seconds: float) -> dict[str, float] | None:
    """Per-second rates and wall-time shares between two counter readings of one process (pure)."""
    if seconds <= 0 or after.batches < before.batches:
        return None
    return {
        "batches_per_s": (after.batches - before.batches) / seconds,
        "tokens_per_s": (after.tokens - before.tokens) / seconds,
        "output_tokens_per_s": (after.generated_tokens - before.generated_tokens) / seconds,
        "compute_share": (after.compute_seconds - before.compute_seconds) / seconds,
        "wait_share": (after.wait_seconds - before.wait_seconds) / seconds,
        "send_share": (after.send_seconds - before.send_seconds) / seconds,
    }


def _stage_json(stage: StageSnapshot, rates: dict[str, float] | None, restarts: int, wall_now: float) -> dict:
    stats = stage.stats
    out = stage.to_json()
    out.update({
        "uptime_s": max(0.0, wall_now - stage.started_at) if stage.started_at else None,
        "restarts": restarts,
        "kv_use": stats.kv_tokens / stats.kv_token_capacity if stats.kv_token_capacity else None,
        "rates": rates,
    })
    return out


_NO_LATENCY: Mapping[str, Any] = {"ttft_s": None, "itl_s": None}


@dataclass(frozen=True)
class Sample:
    at: float  # monotonic seconds
    stages: dict[StageKey, StageSnapshot]
    gateway: GatewayCounters


def build_document(snapshot: MeshSnapshot, rate_base: Sample | None, error_base: Sample | None, now: float,
                   gateway: GatewayCounters, latency: Mapping[str, Any], outstanding: Mapping[int, int],
                   wall_now: float, auth_required: bool,
                   replica_latency: Mapping[int, Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """The live JSON (pure): ``rate_base`` is a sample a few seconds old, ``error_base`` up to a minute old."""
    replicas = []
    total_output: float | None = None
    for replica in snapshot.replicas:
        stages = []
        for stage in replica.stages:
            before = rate_base.stages.get((replica.replica, stage.rank, stage.pid)) if rate_base else None
            rates = stage_rates(before.stats, stage.stats, now - rate_base.at) if before and rate_base else None
            stages.append(_stage_json(stage, rates, replica.restarts, wall_now))
        entry_rates = stages[0]["rates"] if stages else None
        output = entry_rates["output_tokens_per_s"] if entry_rates else None
        if output is not None:
            total_output = (total_output or 0.0) + output
        failures = gateway.replica_failures.get(replica.replica, 0)
        recent_failures = (failures - error_base.gateway.replica_failures.get(replica.replica, 0)
                           if error_base is not None else None)
        routed = {policy: dict(gateway.replica_routed).get((replica.replica, policy), 0)
                  for policy in ("key", "prefix", "load")}
        entry = replica.stages[0].stats if replica.stages else None
        hit_rate = (entry.prefix_cache_hits / entry.prefix_cache_queries
                    if entry is not None and entry.prefix_cache_queries else None)
        replicas.append({"replica": replica.replica, "healthy": replica.healthy, "restarts": replica.restarts,
                         "state": replica.state.value, "consecutive_failures": replica.consecutive_failures,
                         "backoff_s": replica.backoff_s, "next_restart_at": replica.next_restart_at,
                         "in_flight": outstanding.get(replica.replica, 0), "output_tokens_per_s": output,
                         "failures_total": failures, "recent_failures": recent_failures,
                         "routed": routed, "prefix_cache_hit_rate": hit_rate,
                         **(replica_latency or {}).get(replica.replica, _NO_LATENCY), "stages": stages})
    depth = max((s.layers[1] for r in snapshot.replicas for s in r.stages), default=0)
    errors_window = None
    if error_base is not None:
        errors_window = {"seconds": now - error_base.at,
                         "client_errors": gateway.client_errors - error_base.gateway.client_errors,
                         "server_errors": gateway.server_errors - error_base.gateway.server_errors,
                         "requests": gateway.requests - error_base.gateway.requests}
    return {
        "time": wall_now,
        "model": snapshot.model,
        "num_layers": depth,
        "auth_required": auth_required,
        "replicas": replicas,
        "overall": {
            "healthy_replicas": len(snapshot.healthy_replicas),
            "output_tokens_per_s": total_output,
            "requests_running": gateway.running,
            "requests_total": gateway.requests,
            "client_errors_total": gateway.client_errors,
            "server_errors_total": gateway.server_errors,
            "recent": errors_window,
            **latency,
        },
        "events": [e.to_json() for e in snapshot.events],
    }


class LiveSampler:
    """The handful of recent samples the rates are taken against.

    The snapshot holds the stages, their health, their ``StageStats`` counters and the event journal; the
    metrics hold requests by status, the requests-running gauge and the last minute of TTFT / inter-token
    latency. Rates (batches/s, tokens/s, compute / wait / send shares of wall time, output tokens/s) are taken
    over about ``rate_window_s``, error counts over ``error_window_s``. Each ``document`` keeps (now, the
    stages, the gateway counters) at most once per ``min_interval_s`` and forgets samples older than
    ``error_window_s``.
    """

    def __init__(self, metrics: GatewayMetrics, rate_window_s: float = RATE_WINDOW_S,
                 error_window_s: float = ERROR_WINDOW_S, min_interval_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._metrics = metrics
        self._rate_window = rate_window_s
        self._error_window = error_window_s
        self._min_interval = min_interval_s
        self._clock = clock
        self._samples: deque[Sample] = deque()
        self._lock = threading.Lock()

    def _bases(self, now: float) -> tuple[Sample | None, Sample | None]:
        """The oldest sample within the rate window (else the newest older one) and the oldest overall."""
        if not self._samples:
            return None, None
        rate_base = next((s for s in self._samples if now - s.at <= self._rate_window), self._samples[-1])
        return rate_base, self._samples[0]

    def document(self, snapshot: MeshSnapshot, outstanding: Mapping[int, int], *, auth_required: bool,
                 wall_now: float | None = None) -> dict[str, Any]:
        now = self._clock()
        gateway = GatewayCounters.read(self._metrics)
        with self._lock:
            while self._samples and now - self._samples[0].at > self._error_window:
                self._samples.popleft()
            rate_base, error_base = self._bases(now)
            if not self._samples or now - self._samples[-1].at >= self._min_interval:
                self._samples.append(Sample(now, _stages(snapshot), gateway))
        if rate_base is not None and now - rate_base.at <= 0:
            rate_base = None
        latency = {"ttft_s": self._metrics.recent_ttft.summary(), "itl_s": self._metrics.recent_itl.summary(),
                   "latency_window_s": self._metrics.recent_ttft.window_s}
        by_replica = {replica: {"ttft_s": ttft.summary(), "itl_s": itl.summary()}
                      for replica, (ttft, itl) in list(self._metrics.recent_by_replica.items())}
        return build_document(snapshot, rate_base, error_base, now, gateway, latency, outstanding,
                              time.time() if wall_now is None else wall_now, auth_required, by_replica)
