"""The last minute of a latency, for percentiles a person can read live.

Contract:
- ``RecentWindow(window_s, max_samples, clock)``: ``add(value, weight)`` records ``weight`` observations of
  ``value`` now; samples older than ``window_s`` are dropped on every call, and at most ``max_samples`` are
  kept (the oldest go first) so memory stays bounded under any load.
- ``summary(quantiles)`` -> ``{"count": n, "p50": seconds, …}`` over the window (weighted, nearest-rank);
  ``None`` values when it is empty.
- Thread-safe (observations come from the event loop, reads from anywhere).
``GatewayMetrics`` (``gateway.http.metrics``) feeds it; the dashboard (``gateway.http.live``) reads it.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

DEFAULT_QUANTILES = (0.5, 0.9, 0.99)


def weighted_quantile(samples: Sequence[tuple[float, int]], q: float) -> float | None:
    """The nearest-rank ``q`` quantile of (value, weight) samples (pure); None when empty."""
    total = sum(w for _, w in samples)
    if total <= 0:
        return None
    rank = max(1, math.ceil(q * total))
    seen = 0
    for value, weight in sorted(samples):
        seen += weight
        if seen >= rank:
            return value
    return max(v for v, _ in samples)


class RecentWindow:
    """Prometheus histograms count since the gateway started, and their percentiles need a Prometheus to take
    rates over buckets. The dashboard wants "p50 / p90 / p99 over the last minute" without one, so
    ``GatewayMetrics`` hands every latency it observes for a histogram to a ``RecentWindow`` as well: same
    observation, same place, kept for ``window_s``."""

    def __init__(self, window_s: float = 60.0, max_samples: int = 20_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if window_s <= 0 or max_samples < 1:
            raise ValueError("window_s must be positive and max_samples at least 1")
        self.window_s = window_s
        self._samples: deque[tuple[float, float, int]] = deque(maxlen=max_samples)  # (when, value, weight)
        self._clock = clock
        self._lock = threading.Lock()

    def _expire(self, now: float) -> None:
        horizon = now - self.window_s
        while self._samples and self._samples[0][0] < horizon:
            self._samples.popleft()

    def add(self, value: float, weight: int = 1) -> None:
        if weight < 1:
            return
        now = self._clock()
        with self._lock:
            self._expire(now)
            self._samples.append((now, value, weight))

    def summary(self, quantiles: Sequence[float] = DEFAULT_QUANTILES) -> dict[str, float | int | None]:
        with self._lock:
            self._expire(self._clock())
            samples = [(value, weight) for _, value, weight in self._samples]
        out: dict[str, float | int | None] = {"count": sum(w for _, w in samples)}
        for q in quantiles:
            out[f"p{round(q * 100):d}"] = weighted_quantile(samples, q)
        return out
