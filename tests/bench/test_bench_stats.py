"""Statistics of stagemesh bench: percentiles, ITL from timestamps, TPOT, throughput windows, pooling, ratios."""

from __future__ import annotations

import numpy as np
import pytest

from stagemesh.bench.stats import (
    distribution,
    error_samples,
    inter_token_latencies,
    level_metrics,
    percentile,
    ratios,
    run_window,
    tpot,
)
from stagemesh.bench.types import RequestRecord


def rec(start=0.0, latency=1.0, chunks=(0.1, 0.2, 0.3), tokens=None, ok=True, status=200, error=None,
        endpoint="a", level="concurrency=1", round_=1, prompt_tokens=10) -> RequestRecord:
    return RequestRecord(endpoint=endpoint, level=level, round=round_, index=0, start=start, latency=latency,
                         ttft=chunks[0] if chunks else None, chunk_times=tuple(chunks),
                         output_tokens=len(chunks) if tokens is None else tokens, output_tokens_source="chunks",
                         prompt_tokens=prompt_tokens, prompt_tokens_source="words", ok=ok, status=status, error=error)


@pytest.mark.parametrize("values", [[5.0], [1.0, 2.0], [3.0, 1.0, 2.0, 10.0],
                                    list(np.random.default_rng(0).random(101))])
@pytest.mark.parametrize("q", [0, 50, 90, 99, 100])
def test_percentile_matches_numpys_linear_interpolation(values, q):
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_and_distribution_of_nothing_are_none():
    assert percentile([], 50) is None
    d = distribution([])
    assert (d.count, d.mean, d.p50, d.p99, d.max) == (0, None, None, None, None)


def test_distribution():
    d = distribution([1.0, 2.0, 3.0, 4.0])
    assert (d.count, d.mean, d.p50, d.max) == (4, 2.5, 2.5, 4.0)
    assert d.p90 == pytest.approx(3.7)


def test_itl_is_every_gap_between_chunks_and_not_the_ttft():
    assert inter_token_latencies([0.5, 0.6, 0.8, 1.1]) == pytest.approx([0.1, 0.2, 0.3])
    assert inter_token_latencies([0.5]) == []
    assert inter_token_latencies([]) == []


def test_tpot_spreads_decode_time_over_tokens_after_the_first():
    # 11 tokens (from usage: chunks may carry several), first at 0.2 s, done at 1.2 s -> 0.1 s per token
    assert tpot(rec(latency=1.2, chunks=(0.2, 0.7, 1.2), tokens=11)) == pytest.approx(0.1)
    assert tpot(rec(chunks=(0.2,), tokens=1)) is None


def test_run_window_is_first_send_to_last_end_failures_included():
    records = [rec(start=1.0, latency=2.0), rec(start=1.5, latency=0.5), rec(start=2.0, latency=3.0, ok=False)]
    assert run_window(records) == pytest.approx(4.0)
    assert run_window([]) == 0.0


def test_level_metrics_throughput_over_the_summed_windows_of_the_rounds():
    records = [
        rec(start=0.0, latency=2.0, chunks=(0.5, 1.0, 2.0), tokens=10, round_=1),
        rec(start=1.0, latency=1.0, chunks=(0.2, 1.0), tokens=10, round_=1),  # round 1 window: 0..2 s
        rec(start=5.0, latency=2.0, chunks=(0.5, 2.0), tokens=20, round_=2),  # round 2 window: 5..7 s
        rec(start=5.0, latency=0.1, chunks=(), ok=False, status=503, error="overloaded", round_=2),
    ]
    m = level_metrics(records)
    assert (m.sent, m.completed, m.failed, m.rounds) == (4, 3, 1, 2)
    assert m.wall_time == pytest.approx(4.0)  # not 7: the idle gap between rounds is not the server's time
    assert m.output_tokens == 40 and m.input_tokens == 30
    assert m.output_tokens_per_s == pytest.approx(10.0)
    assert m.total_tokens_per_s == pytest.approx(17.5)
    assert m.requests_per_s == pytest.approx(0.75)
    assert m.ttft.count == 3 and m.ttft.p50 == pytest.approx(0.5)
    assert m.itl.count == 4  # 2 + 1 + 1 gaps; the failed request contributes none
    assert m.itl.mean == pytest.approx((0.5 + 1.0 + 0.8 + 1.5) / 4)
    assert m.e2el.count == 3
    assert [(e.status, e.message, e.count) for e in m.errors] == [(503, "overloaded", 1)]


def test_error_samples_group_and_count_distinct_errors():
    records = [rec(ok=False, status=503, error="busy")] * 3 + [rec(ok=False, status=None, error="ConnectError")]
    samples = error_samples(records + [rec()])
    assert [(e.status, e.message, e.count) for e in samples] == [(503, "busy", 3), (None, "ConnectError", 1)]


def test_ratios_compare_each_endpoint_to_the_first_per_level_and_round():
    def level(endpoint, level_name, tokens_per_request, itl, round_):
        chunks = tuple(0.1 + itl * i for i in range(5))
        return rec(endpoint=endpoint, level=level_name, round_=round_, chunks=chunks, tokens=tokens_per_request,
                   latency=chunks[-1])

    per_round = [level_metrics([level(ep, "concurrency=1", tok, itl, r)])
                 for r in (1, 2) for ep, tok, itl in (("a", 10, 0.01), ("b", 5, 0.02))]
    pooled = [level_metrics([level(ep, "concurrency=1", tok, itl, r) for r in (1, 2)])
              for ep, tok, itl in (("a", 10, 0.01), ("b", 5, 0.02))]
    (r,) = ratios(pooled, per_round, ["a", "b"])
    assert (r.level, r.endpoint, r.baseline) == ("concurrency=1", "b", "a")
    assert r.itl_p50 == pytest.approx(2.0)
    assert r.ttft_p50 == pytest.approx(1.0)
    assert r.output_tokens_per_s == pytest.approx(5 / 0.18 / (10 / 0.14))
    assert len(r.output_tokens_per_s_by_round) == 2
    assert ratios(pooled, per_round, ["a"]) == []
