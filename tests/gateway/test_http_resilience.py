"""Failures of the mesh, client disconnects and load balancing, through HTTP."""

from __future__ import annotations

import json

import grpc
import httpx
import openai
import pytest

from .conftest import MODEL
from .fakes import wait_for

CHAT = [{"role": "user", "content": "hi"}]


def sse_events(r: httpx.Response) -> list[str]:
    return [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]


def test_no_healthy_replica_is_503(client, server, healthy_mesh, stage):
    healthy_mesh.healthy[0] = False
    with pytest.raises(openai.InternalServerError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT)
    assert e.value.status_code == 503 and e.value.body["code"] == "no_healthy_replica"
    r = httpx.get(f"{server.url}/health")
    assert r.status_code == 503 and "error" in r.json()
    assert not stage.requests


@pytest.mark.parametrize("code", [grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE])
def test_refusing_stage_is_503_overloaded(client, server, stage, code):
    stage.script.fail_before = code
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model=MODEL, prompt="x")
    assert e.value.status_code == 503 and "overloaded" in e.value.body["message"]
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "stream": True})
    assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded"


def test_invalid_argument_from_stage_is_400(client, stage):
    stage.script.fail_before = grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x")


def test_pipeline_failure_mid_request(server, stage):
    stage.script.fail_after_tokens = 2
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and r.headers["x-should-retry"] == "false"
    assert r.json()["error"]["code"] == "pipeline_failed"
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={"messages": CHAT, "stream": True}) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "pipeline_failed" and set(error) == {"message", "type", "param", "code"}
    assert json.loads(events[1])["choices"][0]["delta"]["content"] == "Hello"


def test_streaming_disconnect_cancels_the_grpc_call(server, stage):
    stage.script.hang_after_tokens = 2
    with httpx.stream("POST", f"{server.url}/v1/completions", json={"prompt": "x", "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # got a token; now hang up
    assert wait_for(lambda: len(stage.cancelled) == 1), "the stage never saw the cancellation"


def test_non_streaming_disconnect_cancels_the_grpc_call(server, stage):
    stage.script.hang_after_tokens = 1
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json={"messages": CHAT, "n": 2}, timeout=0.5)
    assert wait_for(lambda: len(stage.cancelled) == 2), "the stage never saw the cancellation"
    # The slots are free: the next request is served at once.
    stage.script.hang_after_tokens = None
    assert httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"}, timeout=5).status_code == 200


def test_a_replica_that_only_missed_a_health_check_still_serves_when_no_other_can(client, healthy_mesh, stages,
                                                                                   stage):
    """One slow health answer (a loaded machine) leaves the lone replica serving, not a 503; beside a healthy
    replica, the suspect one gets nothing."""
    healthy_mesh.suspect.add(0)
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=1).choices[0].text is not None
    assert len(stage.requests) == 1
    healthy_mesh.ports[:] = [stages[0].port, stages[1].port]
    for _ in range(3):
        client.completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert len(stages[0].servicer.requests) == 1 and len(stages[1].servicer.requests) == 3


def test_requests_alternate_between_idle_replicas(client, healthy_mesh, stages, stage):
    healthy_mesh.ports[:] = [stages[0].port, stages[1].port]
    for _ in range(4):
        client.completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert len(stages[0].servicer.requests) == 2 and len(stages[1].servicer.requests) == 2
    healthy_mesh.healthy[1] = False
    for _ in range(2):
        client.completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert len(stages[0].servicer.requests) == 4 and len(stages[1].servicer.requests) == 2


def test_refused_before_any_token_fails_over_to_another_replica(client, healthy_mesh, stages, stage):
    healthy_mesh.ports[:] = [stages[0].port, stages[1].port]
    stages[0].servicer.script.fail_before = grpc.StatusCode.UNAVAILABLE
    for _ in range(2):
        r = client.completions.create(model=MODEL, prompt="x", max_tokens=1)
        assert r.choices[0].text == "Hello"
    assert len(stages[1].servicer.requests) == 2


def test_deadline_is_504_without_retry(mesh, tokenizer, eos_ids, stage):
    from gateway.app import GatewayConfig, create_app

    from .fakes import AppServer

    stage.script.hang_after_tokens = 1
    app = create_app(GatewayConfig(served_model_name=MODEL, max_model_len=2048, request_timeout_s=0.3), mesh=mesh,
                     tokenizer=tokenizer, eos_token_ids=eos_ids)
    server = AppServer(app).start()
    try:
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"}, timeout=10)
        assert r.status_code == 504 and r.headers["x-should-retry"] == "false"
        assert r.json()["error"]["code"] == "timeout"
    finally:
        server.stop()


def test_busy_replica_is_avoided(server, healthy_mesh, stages, stage):
    from .fakes import Script

    healthy_mesh.ports[:] = [stages[0].port, stages[1].port]
    reply = list(stage.script.reply_ids)
    for s in stages:
        s.servicer.script.hang_after_tokens = 1
    with httpx.stream("POST", f"{server.url}/v1/completions", json={"prompt": "x", "stream": True}) as r:
        lines = r.iter_lines()  # keep a reference: a collected iterator closes the connection
        assert next(lines).startswith("data: ")
        busy = 0 if stages[0].servicer.requests else 1
        for s in stages:
            s.servicer.script = Script(reply_ids=reply)  # the hanging call keeps its own script
        for _ in range(2):
            assert httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"}).status_code == 200
        assert len(stages[busy].servicer.requests) == 1 and len(stages[1 - busy].servicer.requests) == 2
    assert wait_for(lambda: len(stages[busy].servicer.cancelled) == 1)
    assert wait_for(lambda: not server.app.state.replica_client.balancer.snapshot())  # nothing leaked


def test_dead_entry_stage_fails_fast_or_fails_over(client, healthy_mesh, stages, stage):
    import time

    from .fakes import free_port

    healthy_mesh.ports[:] = [free_port()]  # nothing listens there, yet the mesh says healthy
    t0 = time.monotonic()
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model=MODEL, prompt="x")
    assert e.value.status_code == 503 and time.monotonic() - t0 < 5
    healthy_mesh.ports[:] = [free_port(), stages[0].port]
    for _ in range(2):
        assert client.completions.create(model=MODEL, prompt="x", max_tokens=1).choices[0].text == "Hello"
