"""The gateway's requests to one entry stage share one ``GenerateStream`` call, and a stage that does
not serve it (an older stagemesh) is still served, one ``Generate`` call per request."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from gateway.app import GatewayConfig, create_app

from .conftest import MODEL
from .fakes import AppServer, FakeMesh, FakeStage, StageServer, StreamingFakeStage


def _chat(client: openai.OpenAI, text: str) -> str:
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}])
    return reply.choices[0].message.content or ""


@pytest.fixture
def own_gateway(tokenizer, eos_ids):
    """A fresh fake stage behind a fresh gateway app: ``stage`` is the servicer to serve (default: one
    with GenerateStream); returns it, the gateway's client and the gateway's mesh view."""
    made: list[tuple[StageServer, AppServer]] = []

    def make(stage: FakeStage | None = None) -> tuple[FakeStage, openai.OpenAI, FakeMesh]:
        servicer = stage if stage is not None else StreamingFakeStage(eos_id=2)
        servicer.reset(reply_ids=tokenizer.encode("Hello there!", add_special_tokens=False))
        server = StageServer(servicer).start()
        mesh = FakeMesh(ports=[server.port])
        app = AppServer(create_app(GatewayConfig(served_model_name=MODEL, max_model_len=2048, request_timeout_s=30),
                                   mesh=mesh, tokenizer=tokenizer, eos_token_ids=eos_ids)).start()
        made.append((server, app))
        client = openai.OpenAI(base_url=f"{app.url}/v1", api_key="unused", max_retries=0, timeout=20)
        return servicer, client, mesh

    yield make
    for stage, app in made:
        app.stop()
        stage.stop()


def test_concurrent_requests_to_one_stage_share_one_generate_stream(own_gateway):
    stage, client, _ = own_gateway()
    assert isinstance(stage, StreamingFakeStage)
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda i: _chat(client, f"question {i}"), range(16)))
    assert replies == ["Hello there!"] * 16
    assert len(stage.requests) == 16
    assert stage.stream_calls == 1  # all sixteen over the one call, opened by the first


def test_a_stage_without_generate_stream_is_served_one_generate_call_per_request(own_gateway):
    stage, client, _ = own_gateway(FakeStage(eos_id=2))  # an older stage: no GenerateStream method at all
    assert [_chat(client, "hi"), _chat(client, "again")] == ["Hello there!"] * 2
    assert len(stage.requests) == 2  # both reached the scripted Generate


def test_a_new_stage_process_at_the_target_is_tried_with_generate_stream_again(own_gateway):
    stage, client, mesh = own_gateway(StreamingFakeStage(eos_id=2, generate_stream=False))
    assert isinstance(stage, StreamingFakeStage)
    assert _chat(client, "hi") == "Hello there!"
    assert stage.stream_calls == 0 and len(stage.requests) == 1  # UNIMPLEMENTED, then Generate
    stage.generate_stream = True  # the same process learns nothing new: it stays on Generate
    assert _chat(client, "again") == "Hello there!"
    assert stage.stream_calls == 0 and len(stage.requests) == 2
    mesh.pid_base += 100  # an upgraded stage process now serves the port
    assert _chat(client, "and again") == "Hello there!"
    assert stage.stream_calls == 1 and len(stage.requests) == 3


def test_the_stage_accepts_the_keepalive_pings_the_gateway_sends_on_an_idle_stream():
    """gRPC's server default answers pings closer than 5 min apart on a call without data with GOAWAY
    (too_many_pings), which killed the gateway's idle GenerateStream call after about a minute (seen
    with 1 s pings against a default server); the stage must accept the gateway's cadence."""
    from stage_worker.grpc_service import SERVER_OPTIONS

    client = dict(GatewayConfig(served_model_name=MODEL, max_model_len=2048).grpc_channel_options)
    server = dict(SERVER_OPTIONS)
    assert client["grpc.keepalive_time_ms"] >= server["grpc.http2.min_ping_interval_without_data_ms"]
    assert client["grpc.http2.max_pings_without_data"] == 0  # keep pinging an idle call: a dead host shows
