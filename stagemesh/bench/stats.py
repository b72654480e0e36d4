"""Statistics of ``stagemesh bench serve``: pure functions from request records to metrics.

Contract: ``percentile(values, q)`` interpolates linearly between closest ranks (numpy's default), ``None``
for no values. ``inter_token_latencies``, ``tpot`` and ``run_window`` are the per-request and per-run
figures; ``level_metrics(records)`` pools the records of one (endpoint, level), possibly from several
rounds, into a ``LevelMetrics``: distributions pool every request, throughputs divide tokens of successful
requests by the summed wall time of the rounds, and failed requests are counted and sampled, never dropped.
``ratios`` compares every endpoint to the first, level by level. Nothing here does I/O or reads a clock.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

from stagemesh.bench.types import RequestRecord

PERCENTILES = (50, 90, 99)
ERROR_SAMPLES = 5  # distinct errors kept per level; each with its count


@dataclass(frozen=True)
class Distribution:
    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    max: float | None


@dataclass(frozen=True)
class ErrorSample:
    status: int | None
    message: str
    count: int


@dataclass(frozen=True)
class LevelMetrics:
    endpoint: str
    level: str
    rounds: int
    sent: int
    completed: int
    failed: int
    wall_time: float
    requests_per_s: float | None
    output_tokens: int
    input_tokens: int
    output_tokens_per_s: float | None
    total_tokens_per_s: float | None
    ttft: Distribution
    itl: Distribution
    tpot: Distribution
    e2el: Distribution
    errors: tuple[ErrorSample, ...]
    ttft_by_turn: tuple[Distribution, ...] = ()  # multi-turn: index t - 1 holds turn t

    def to_dict(self) -> dict:
        return asdict(self)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation between closest ranks."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def distribution(values: Sequence[float]) -> Distribution:
    if not values:
        return Distribution(0, None, None, None, None, None)
    p50, p90, p99 = (percentile(values, q) for q in PERCENTILES)
    return Distribution(len(values), sum(values) / len(values), p50, p90, p99, max(values))


def inter_token_latencies(chunk_times: Sequence[float]) -> list[float]:
    """The gaps between consecutive streamed chunks with text; the first chunk's time is the TTFT, not an ITL."""
    return [b - a for a, b in zip(chunk_times, chunk_times[1:])]


def tpot(record: RequestRecord) -> float | None:
    """(latency - TTFT) / (output tokens - 1); ``None`` below 2 tokens."""
    if record.ttft is None or record.output_tokens < 2:
        return None
    return (record.latency - record.ttft) / (record.output_tokens - 1)


def run_window(records: Iterable[RequestRecord]) -> float:
    """The wall time of one run: first send to last end, failed requests included (they occupied the server
    too)."""
    records = list(records)
    if not records:
        return 0.0
    return max(r.start + r.latency for r in records) - min(r.start for r in records)


def throughput(amount: float, seconds: float) -> float | None:
    return amount / seconds if seconds > 0 else None


def error_samples(records: Iterable[RequestRecord], limit: int = ERROR_SAMPLES) -> tuple[ErrorSample, ...]:
    counts = Counter((r.status, r.error or "unknown error") for r in records if not r.ok)
    return tuple(ErrorSample(status, message, n) for (status, message), n in counts.most_common(limit))


def ttft_by_turn(records: Iterable[RequestRecord]) -> tuple[Distribution, ...]:
    """TTFT of successful requests, turn by turn (1, 2, ...); empty when no record has a turn. Turn 1 finds at
    most the system prompt cached, later turns their conversation's history."""
    by_turn: dict[int, list[float]] = {}
    last = 0
    for r in records:
        last = max(last, r.turn)
        if r.ok and r.turn and r.ttft is not None:
            by_turn.setdefault(r.turn, []).append(r.ttft)
    return tuple(distribution(by_turn.get(turn, [])) for turn in range(1, last + 1))


def level_metrics(records: Sequence[RequestRecord]) -> LevelMetrics:
    """Metrics of one (endpoint, level) from all its records (every round): distributions pool every request
    (ITL: every gap), throughputs divide tokens of successful requests by the summed wall time of the rounds;
    failed requests are counted and sampled, never dropped. For the multi-turn workload ``ttft_by_turn[t - 1]``
    is the TTFT of turn t's successful requests (empty otherwise)."""
    if not records:
        raise ValueError("level_metrics needs at least one record")
    by_round: dict[int, list[RequestRecord]] = {}
    for r in records:
        by_round.setdefault(r.round, []).append(r)
    wall = sum(run_window(rs) for rs in by_round.values())
    good = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in good)
    in_tokens = sum(r.prompt_tokens for r in good)
    itls = [gap for r in good for gap in inter_token_latencies(r.chunk_times)]
    tpots = [t for t in (tpot(r) for r in good) if t is not None]
    return LevelMetrics(
        endpoint=records[0].endpoint,
        level=records[0].level,
        rounds=len(by_round),
        sent=len(records),
        completed=len(good),
        failed=len(records) - len(good),
        wall_time=wall,
        requests_per_s=throughput(len(good), wall),
        output_tokens=out_tokens,
        input_tokens=in_tokens,
        output_tokens_per_s=throughput(out_tokens, wall),
        total_tokens_per_s=throughput(out_tokens + in_tokens, wall),
        ttft=distribution([r.ttft for r in good if r.ttft is not None]),
        itl=distribution(itls),
        tpot=distribution(tpots),
        e2el=distribution([r.latency for r in good]),
        errors=error_samples(records),
        ttft_by_turn=ttft_by_turn(records),
    )


def _ratio(value: float | None, base: float | None) -> float | None:
    if value is None or base is None or base == 0:
        return None
    return value / base


@dataclass(frozen=True)
class Ratio:
    """An endpoint against the first endpoint at one level (>1 tok/s is faster; >1 TTFT/ITL is slower)."""

    level: str
    endpoint: str
    baseline: str
    output_tokens_per_s: float | None
    ttft_p50: float | None
    itl_p50: float | None
    output_tokens_per_s_by_round: tuple[float | None, ...]
    ttft_p50_by_turn: tuple[float | None, ...] = ()  # multi-turn: index t - 1 holds turn t


def ratios(pooled: Sequence[LevelMetrics], per_round: Sequence[LevelMetrics], labels: Sequence[str]) -> list[Ratio]:
    """Each endpoint after the first against the first, per level (TTFT p50 per turn too); also the tok/s
    ratio of every round."""
    if len(labels) < 2:
        return []
    baseline = labels[0]
    pooled_at = {(m.endpoint, m.level): m for m in pooled}
    round_at: dict[tuple[str, str], list[LevelMetrics]] = {}
    for m in per_round:
        round_at.setdefault((m.endpoint, m.level), []).append(m)
    levels = list(dict.fromkeys(m.level for m in pooled))
    out = []
    for level in levels:
        base = pooled_at.get((baseline, level))
        if base is None:
            continue
        for label in labels[1:]:
            other = pooled_at.get((label, level))
            if other is None:
                continue
            by_round = tuple(
                _ratio(a.output_tokens_per_s, b.output_tokens_per_s)
                for a, b in zip(round_at.get((label, level), []), round_at.get((baseline, level), []))
            )
            by_turn = tuple(_ratio(a.p50, b.p50) for a, b in zip(other.ttft_by_turn, base.ttft_by_turn))
            out.append(Ratio(level, label, baseline, _ratio(other.output_tokens_per_s, base.output_tokens_per_s),
                             _ratio(other.ttft.p50, base.ttft.p50), _ratio(other.itl.p50, base.itl.p50), by_round,
                             by_turn))
    return out
