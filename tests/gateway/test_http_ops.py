"""Operational endpoints (/health, /mesh, /metrics, /v1/models) and API keys."""

from __future__ import annotations

import httpx
import openai
import pytest

from stagemesh_core.states import ReplicaState

from .conftest import API_KEY, MODEL


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_health_and_mesh(server, healthy_mesh):
    r = httpx.get(f"{server.url}/health")
    assert r.status_code == 200 and r.json()["healthy_replicas"] == 1
    assert httpx.get(f"{server.url}/mesh").json() == healthy_mesh.snapshot().to_json()


def test_mesh_and_live_data_say_when_a_replica_backs_off(server, healthy_mesh, stages):
    healthy_mesh.ports[:] = [stages[0].port, stages[1].port]
    healthy_mesh.healthy[1] = False
    healthy_mesh.supervision[1] = {"restarts": 3, "state": ReplicaState.BACKING_OFF, "consecutive_failures": 3,
                                   "backoff_s": 4.0, "next_restart_at": 1796046281.5}
    fields = ("restarts", "state", "consecutive_failures", "backoff_s", "next_restart_at")
    mesh = httpx.get(f"{server.url}/mesh").json()
    assert [{k: r[k] for k in fields} for r in mesh["replicas"]] == [
        {"restarts": 0, "state": "serving", "consecutive_failures": 0, "backoff_s": None, "next_restart_at": None},
        {"restarts": 3, "state": "backing_off", "consecutive_failures": 3, "backoff_s": 4.0,
         "next_restart_at": 1796046281.5}]
    assert httpx.get(f"{server.url}/health").json()["healthy_replicas"] == 1
    live = httpx.get(f"{server.url}/dashboard/live").json()
    assert [{k: r[k] for k in fields} for r in live["replicas"]] == [{k: r[k] for k in fields}
                                                                     for r in mesh["replicas"]]


def test_metrics_has_request_and_per_stage_series(client, server):
    client.completions.create(model=MODEL, prompt="x", max_tokens=3)
    text = httpx.get(f"{server.url}/metrics").text
    labels = '{host="127.0.0.1",rank="0",replica="0",worker="0"}'
    for series, value in [("stagemesh_stage_compute_seconds_total", "1.5"),
                          ("stagemesh_stage_wait_seconds_total", "0.25"),
                          ("stagemesh_stage_send_seconds_total", "0.125"),
                          ("stagemesh_stage_batches_total", "10.0"),
                          ("stagemesh_stage_running_sequences", "0.0"),
                          ("stagemesh_stage_prefix_cache_queries_total", "400.0"),
                          ("stagemesh_stage_prefix_cache_hits_total", "96.0"),
                          ("stagemesh_stage_prefix_cache_blocks", "7.0"),
                          ("stagemesh_stage_prefix_cache_evictions_total", "2.0"),
                          ("stagemesh_stage_healthy", "1.0")]:
        assert f"{series}{labels} {value}" in text, series
    assert 'stagemesh_gateway_requests_total{endpoint="/v1/completions",status="200"}' in text
    for name in ("time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                 "e2e_request_latency_seconds_count", "prompt_tokens_total", "generation_tokens_total",
                 "requests_running"):
        assert f"stagemesh_gateway_{name}" in text, name
    count = next(line for line in text.splitlines()
                 if line.startswith("stagemesh_gateway_time_to_first_token_seconds_count"))
    assert float(count.split()[-1]) >= 1


def test_api_key_guards_v1_only(keyed_server, stage, healthy_mesh):
    base = f"{keyed_server.url}/v1"
    c = openai.OpenAI(base_url=base, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        c.models.list()
    assert e.value.body["code"] == "invalid_api_key"
    assert httpx.get(f"{base}/models").status_code == 401  # no key at all
    r = httpx.post(f"{base}/completions", json={"prompt": "x"})
    assert r.status_code == 401 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    ok = openai.OpenAI(base_url=base, api_key=API_KEY, max_retries=0)
    assert ok.completions.create(model=MODEL, prompt="x", max_tokens=1).choices[0].text == "Hello"
    r = httpx.get(f"{base}/models", headers={"Authorization": "bearer other"})  # scheme is case-insensitive
    assert r.status_code == 200
    for open_path in ("/health", "/metrics", "/mesh"):
        assert httpx.get(f"{keyed_server.url}{open_path}").status_code == 200


def test_openapi_documents_the_endpoints(server):
    paths = httpx.get(f"{server.url}/openapi.json").json()["paths"]
    assert "/v1/chat/completions" in paths and "/v1/completions" in paths
