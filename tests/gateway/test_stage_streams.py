"""The gateway's requests to one entry stage share one ``GenerateStream`` call, and a stage that does
not serve it (an older stagemesh) is still served, one ``Generate`` call per request."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from gateway.app import GatewayConfig, create_app

from .conftest import MODEL
from .fakes import AppServer, FakeMesh, StageServer, StreamingFakeStage


def _chat(client: openai.OpenAI, text: str) -> str:
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}])
    return reply.choices[0].message.content or ""


@pytest.fixture
def own_gateway(tokenizer, eos_ids):
    """A fresh fake stage (``generate_stream`` as asked) behind a fresh gateway app."""
    made: list[tuple[StageServer, AppServer]] = []

    def make(generate_stream: bool) -> tuple[StreamingFakeStage, openai.OpenAI]:
        servicer = StreamingFakeStage(eos_id=2, generate_stream=generate_stream)
        servicer.reset(reply_ids=tokenizer.encode("Hello there!", add_special_tokens=False))
        stage = StageServer(servicer).start()
        app = AppServer(create_app(GatewayConfig(served_model_name=MODEL, max_model_len=2048, request_timeout_s=30),
                                   mesh=FakeMesh(ports=[stage.port]), tokenizer=tokenizer,
                                   eos_token_ids=eos_ids)).start()
        made.append((stage, app))
        return servicer, openai.OpenAI(base_url=f"{app.url}/v1", api_key="unused", max_retries=0, timeout=20)

    yield make
    for stage, app in made:
        app.stop()
        stage.stop()


def test_concurrent_requests_to_one_stage_share_one_generate_stream(own_gateway):
    stage, client = own_gateway(generate_stream=True)
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda i: _chat(client, f"question {i}"), range(16)))
    assert replies == ["Hello there!"] * 16
    assert len(stage.requests) == 16
    assert stage.stream_calls == 1  # all sixteen over the one call, opened by the first


def test_a_stage_without_generate_stream_is_served_one_generate_call_per_request(own_gateway):
    stage, client = own_gateway(generate_stream=False)
    assert [_chat(client, "hi"), _chat(client, "again")] == ["Hello there!"] * 2
    assert len(stage.requests) == 2  # both reached the scripted Generate
    assert stage.stream_calls == 0
