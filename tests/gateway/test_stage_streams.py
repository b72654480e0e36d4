"""The gateway's requests to one entry stage share one ``GenerateStream`` call, its one path to a stage."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from gateway.app import GatewayConfig, create_app

from .conftest import MODEL
from .fakes import AppServer, FakeMesh, FakeStage, StageServer


def _chat(client: openai.OpenAI, text: str) -> str:
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}])
    return reply.choices[0].message.content or ""


@pytest.fixture
def own_gateway(tokenizer, eos_ids):
    """A fresh fake stage behind a fresh gateway app; returns the stage and the gateway's client."""
    made: list[tuple[StageServer, AppServer]] = []

    def make() -> tuple[FakeStage, openai.OpenAI]:
        servicer = FakeStage(eos_id=2)
        servicer.reset(reply_ids=tokenizer.encode("Hello there!", add_special_tokens=False))
        server = StageServer(servicer).start()
        mesh = FakeMesh(ports=[server.port])
        app = AppServer(create_app(GatewayConfig(served_model_name=MODEL, max_model_len=2048, request_timeout_s=30),
                                   mesh=mesh, tokenizer=tokenizer, eos_token_ids=eos_ids)).start()
        made.append((server, app))
        client = openai.OpenAI(base_url=f"{app.url}/v1", api_key="unused", max_retries=0, timeout=20)
        return servicer, client

    yield make
    for stage, app in made:
        app.stop()
        stage.stop()


def test_concurrent_requests_to_one_stage_share_one_generate_stream(own_gateway):
    stage, client = own_gateway()
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda i: _chat(client, f"question {i}"), range(16)))
    assert replies == ["Hello there!"] * 16
    assert len(stage.requests) == 16
    assert stage.stream_calls == 1  # all sixteen over the one call, opened by the first


def test_the_stage_accepts_the_keepalive_pings_the_gateway_sends_on_an_idle_stream():
    """gRPC's server default answers pings closer than 5 min apart on a call without data with GOAWAY
    (too_many_pings), which killed the gateway's idle GenerateStream call after about a minute (seen
    with 1 s pings against a default server); the stage must accept the gateway's cadence."""
    from stage_worker.service.grpc_service import SERVER_OPTIONS

    client = dict(GatewayConfig(served_model_name=MODEL, max_model_len=2048).grpc_channel_options)
    server = dict(SERVER_OPTIONS)
    assert client["grpc.keepalive_time_ms"] >= server["grpc.http2.min_ping_interval_without_data_ms"]
    assert client["grpc.http2.max_pings_without_data"] == 0  # keep pinging an idle call: a dead host shows
