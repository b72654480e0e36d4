"""The dashboard's live data: last-minute percentiles, rates between snapshots, the event journal,
and the routes (page, assets, live JSON behind the API key) on a real app over HTTP."""

from __future__ import annotations

from dataclasses import replace

import httpx
import pytest

from gateway.http.live import LiveSampler, stage_rates
from gateway.http.metrics import GatewayMetrics
from gateway.http.recent import RecentWindow, weighted_quantile
from stagemesh_core.events import EventJournal
from stagemesh_core.snapshots import MeshSnapshot, ReplicaSnapshot, StageSnapshot, StageStats

from .conftest import API_KEY


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_weighted_quantile_is_nearest_rank():
    assert weighted_quantile([], 0.5) is None
    assert weighted_quantile([(0.3, 1), (0.1, 1), (0.2, 1)], 0.5) == 0.2
    assert weighted_quantile([(0.1, 9), (5.0, 1)], 0.9) == 0.1
    assert weighted_quantile([(0.1, 9), (5.0, 1)], 0.99) == 5.0


def test_recent_window_forgets_what_is_older_than_its_window():
    clock = Clock()
    window = RecentWindow(window_s=60, clock=clock)
    window.add(2.0)
    clock.now += 30
    window.add(0.5, weight=3)
    assert window.summary() == {"count": 4, "p50": 0.5, "p90": 2.0, "p99": 2.0}
    clock.now += 31  # the 2.0 is now 61 s old
    assert window.summary() == {"count": 3, "p50": 0.5, "p90": 0.5, "p99": 0.5}
    clock.now += 60
    assert window.summary() == {"count": 0, "p50": None, "p90": None, "p99": None}


def test_event_journal_keeps_the_newest_and_numbers_them():
    journal = EventJournal(capacity=2, wall_clock=lambda: 42.0)
    for rank in range(3):
        journal.record("stage_lost", f"stage {rank} died", replica=0, rank=rank)
    assert [(e.seq, e.rank, e.time) for e in journal.recent()] == [(2, 1, 42.0), (3, 2, 42.0)]
    with pytest.raises(ValueError, match="EVENT_KINDS"):
        journal.record("stage_sneezed", "?")


def _snapshot(batches: int, compute: float, pid: int = 7, generated: int = 0) -> MeshSnapshot:
    stats = StageStats(batches=batches, tokens=2 * batches, compute_seconds=compute, wait_seconds=0.5,
                       generated_tokens=generated, kv_tokens=30, kv_token_capacity=120)
    stage = StageSnapshot(0, (0, 30), "127.0.0.1", 1, 2, pid, "n", "float32", False, True, stats=stats)
    return MeshSnapshot("m", (ReplicaSnapshot(0, (stage,)),))


class OneSnapshot:
    def __init__(self, snapshot: MeshSnapshot) -> None:
        self._snapshot = snapshot

    def snapshot(self) -> MeshSnapshot:
        return self._snapshot


def test_stage_rates_are_counter_differences_over_the_seconds_between():
    before, after = _snapshot(10, 1.0).replicas[0].stages[0].stats, _snapshot(30, 3.0).replicas[0].stages[0].stats
    assert stage_rates(before, after, 4.0) == {
        "batches_per_s": 5.0, "tokens_per_s": 10.0, "output_tokens_per_s": 0.0, "compute_share": 0.5,
        "wait_share": 0.0, "send_share": 0.0}
    assert stage_rates(after, before, 4.0) is None  # counters went back: a new process


def test_live_document_rates_kv_use_and_a_restarted_stage():
    clock = Clock()
    metrics = GatewayMetrics(OneSnapshot(_snapshot(0, 0)), dict)
    sampler = LiveSampler(metrics, clock=clock)
    first = sampler.document(_snapshot(10, 1.0, generated=100), {0: 2}, auth_required=False, wall_now=5.0)
    stage = first["replicas"][0]["stages"][0]
    assert stage["rates"] is None and stage["kv_use"] == 0.25 and first["replicas"][0]["in_flight"] == 2
    clock.now += 2
    doc = sampler.document(_snapshot(20, 2.0, generated=140), {}, auth_required=False, wall_now=7.0)
    assert doc["replicas"][0]["stages"][0]["rates"]["batches_per_s"] == 5.0
    assert doc["replicas"][0]["output_tokens_per_s"] == doc["overall"]["output_tokens_per_s"] == 20.0
    clock.now += 2
    restarted = _snapshot(1, 0.1, pid=8)
    assert sampler.document(restarted, {}, auth_required=False)["replicas"][0]["stages"][0]["rates"] is None


def test_latency_percentiles_come_from_the_observations_behind_the_histograms():
    metrics = GatewayMetrics(OneSnapshot(_snapshot(0, 0)), dict)
    metrics.first_token(0.25)
    metrics.inter_token(0.05, 4)
    doc = LiveSampler(metrics).document(_snapshot(0, 0), {}, auth_required=False)
    assert doc["overall"]["ttft_s"] == {"count": 1, "p50": 0.25, "p90": 0.25, "p99": 0.25}
    assert doc["overall"]["itl_s"]["count"] == 4
    body = metrics.render()[0].decode()
    assert "stagemesh_gateway_time_to_first_token_seconds_count 1.0" in body
    assert "stagemesh_gateway_inter_token_latency_seconds_count 4.0" in body


def test_page_and_assets_are_served_from_the_package(server):
    page = httpx.get(f"{server.url}/", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<script src="/dashboard/dashboard.js">' in page.text and "http" not in page.text.replace(
        'http-equiv', '')  # nothing fetched from elsewhere
    js = httpx.get(f"{server.url}/dashboard/dashboard.js", timeout=10)
    assert js.status_code == 200 and "/dashboard/live" in js.text
    missing = httpx.get(f"{server.url}/dashboard/jquery.js", timeout=10)
    assert missing.status_code == 404 and "dashboard.css, dashboard.js" in missing.json()["error"]["message"]


def test_live_data_reflects_the_mesh_and_counts_generation_errors(server, stage, healthy_mesh):
    httpx.post(f"{server.url}/v1/chat/completions", json={"model": "nope", "messages": []}, timeout=10)
    doc = httpx.get(f"{server.url}/dashboard/live", timeout=10).json()
    assert doc["model"] == healthy_mesh.model and doc["auth_required"] is False
    assert [s["layers"] for s in doc["replicas"][0]["stages"]] == [[0, 30]]
    assert doc["overall"]["client_errors_total"] >= 1


def test_live_data_needs_the_key_when_the_gateway_has_one(keyed_server, healthy_mesh):
    url = f"{keyed_server.url}/dashboard/live"
    refused = httpx.get(url, timeout=10)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(url, headers={"Authorization": "Bearer wrong"}, timeout=10).status_code == 401
    doc = httpx.get(url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10).json()
    assert doc["auth_required"] is True
    assert httpx.get(f"{keyed_server.url}/", timeout=10).status_code == 200  # the page itself asks for the key


def test_snapshot_events_are_part_of_the_mesh_document():
    journal = EventJournal(wall_clock=lambda: 1.5)
    journal.record("replica_replaced", "placed again on 10.0.0.2", replica=1)
    snapshot = replace(_snapshot(0, 0), events=journal.recent())
    assert snapshot.to_json()["events"] == [{"seq": 1, "time": 1.5, "kind": "replica_replaced", "replica": 1,
                                            "rank": None, "message": "placed again on 10.0.0.2"}]


def test_per_replica_latency_and_failures_follow_the_replica_that_served(client, server, healthy_mesh, stages,
                                                                         stage):
    """Replica 0 refuses, the call fails over to replica 1: the failure counts for 0, the latencies for 1."""
    import grpc

    from .conftest import MODEL

    def live() -> dict:
        return {r["replica"]: r for r in httpx.get(f"{server.url}/dashboard/live", timeout=10).json()["replicas"]}

    healthy_mesh.ports[:] = [stages[0].port, stages[1].port]
    before = live()
    refused_before = len(stages[0].servicer.requests)
    stages[0].servicer.script.fail_before = grpc.StatusCode.UNAVAILABLE
    for _ in range(2):
        assert client.completions.create(model=MODEL, prompt="x", max_tokens=3).choices[0].text
    after = live()
    # Ties between replicas go round robin, so how many of the two calls tried replica 0 first depends on
    # the calls before this test; each one it refused is one failure of replica 0.
    refused = len(stages[0].servicer.requests) - refused_before
    assert refused >= 1
    assert after[0]["failures_total"] - before[0]["failures_total"] == refused
    assert after[1]["failures_total"] == before[1]["failures_total"]
    ttft_before = (before[1]["ttft_s"] or {"count": 0})["count"]
    assert after[1]["ttft_s"]["count"] - ttft_before == 2
    assert after[1]["itl_s"]["count"] >= 2  # the tokens after the first
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert f'stagemesh_gateway_replica_failures_total{{replica="0"}} {float(after[0]["failures_total"])}' in metrics


def test_kv_use_and_output_tokens_are_in_metrics_too():
    """The dashboard's per-stage figures are the snapshot's counters, which /metrics exports as well."""
    metrics = GatewayMetrics(OneSnapshot(_snapshot(3, 1.0, generated=17)), dict)
    body = metrics.render()[0].decode()
    labels = '{host="127.0.0.1",rank="0",replica="0",worker="0"}'
    for line in (f"stagemesh_stage_kv_tokens{labels} 30.0", f"stagemesh_stage_kv_token_capacity{labels} 120.0",
                 f"stagemesh_stage_generated_tokens_total{labels} 17.0"):
        assert line in body, line
