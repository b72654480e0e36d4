"""A mixture-of-experts model served at PP=2 through the OpenAI SDK: what sits above the model works as it
does for the dense ones.

The tiny random-weight ``qwen3_moe`` checkpoint of ``tests/architectures.py`` (mlx-community's layout, the
default model's tokenizer), served by ``stagemesh serve -pp 2``: greedy text equals mlx-lm's own generation on
the same files, logprobs come with every token, structured output and a forced tool call follow their schemas,
a stop string ends the text before it, an aborted stream leaves the server serving, and a stage killed while
a request streams fails that stream with an error (no hang) and its replica comes back serving the same text.
"""

from __future__ import annotations

import json
import os
import signal

import mlx.core as mx
import openai
import pytest

from tests.architectures import tiny_checkpoint
from tests.coordinator.helpers import wait_until
from tests.e2e.serve_process import start_serve

pytestmark = pytest.mark.e2e

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("moe"))


@pytest.fixture(scope="module")
def client(checkpoint, tmp_path_factory):
    server = start_serve(tmp_path_factory.mktemp("moe-serve"), checkpoint, "--max-model-len", "512", pp=2)
    try:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0), server
    finally:
        server.stop()


def _model(client) -> str:
    return client[0].models.list().data[0].id


def test_greedy_completion_equals_mlx_lm_generation(client, checkpoint):
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load

    model, tokenizer = load(checkpoint)
    prompt = tokenizer.encode(PROMPT)
    expected = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=16,
                                                 sampler=lambda x: mx.argmax(x, axis=-1))]
    r = client[0].completions.create(model=_model(client), prompt=PROMPT, max_tokens=16, temperature=0,
                                     logprobs=1, extra_body={"ignore_eos": True})
    choice = r.choices[0]
    assert r.usage.completion_tokens == 16 and len(choice.logprobs.tokens) == 16
    assert choice.text == tokenizer.decode(expected)
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)


def test_structured_output_and_a_forced_tool_call_follow_their_schemas(client):
    c, model = client[0], _model(client)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "mood": {"enum": ["calm", "busy"]}},
              "required": ["ok", "mood"], "additionalProperties": False}
    r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Answer in JSON."}],
                                  temperature=0, max_tokens=60,
                                  response_format={"type": "json_schema",
                                                   "json_schema": {"name": "a", "schema": schema}})
    answer = json.loads(r.choices[0].message.content)
    assert isinstance(answer["ok"], bool) and answer["mood"] in ("calm", "busy")
    tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}}}
    r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Pick a city."}],
                                  tools=[tool], tool_choice={"type": "function", "function": {"name": "pick"}},
                                  temperature=0, max_tokens=60)
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "pick" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")


def test_a_stop_string_and_an_aborted_stream(client):
    c, model = client[0], _model(client)
    whole = c.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0,
                                 extra_body={"ignore_eos": True}).choices[0].text
    stop = whole[len(whole) // 2:][:3]
    assert stop.strip(), whole
    cut = c.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop],
                               extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop" and cut.text == whole[:whole.index(stop)]
    stream = c.completions.create(model=model, prompt=PROMPT, max_tokens=200, temperature=0, stream=True,
                                  extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()  # the client goes away mid-stream: the request is aborted on the stages
    again = c.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0,
                                 extra_body={"ignore_eos": True}).choices[0].text
    assert again == whole


def test_a_stage_killed_while_a_request_streams_fails_it_and_the_replica_comes_back(client):
    """Last in the module: it restarts the replica the other tests use."""
    c, server = client
    model = _model(client)
    whole = c.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0,
                                 extra_body={"ignore_eos": True}).choices[0].text
    victim = server.mesh()["replicas"][0]["stages"][1]["pid"]
    # A generous read timeout only turns a hang into a failure the assertion below tells apart.
    stream = c.with_options(timeout=120).completions.create(model=model, prompt=PROMPT, max_tokens=480,
                                                            temperature=0, stream=True,
                                                            extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)
    os.kill(victim, signal.SIGKILL)  # the last stage, by its pid, mid-generation
    with pytest.raises(openai.APIError) as failure:
        for _ in chunks:
            pass
    assert not isinstance(failure.value, openai.APITimeoutError), "the stream hung instead of failing"
    stream.close()

    def serving_again() -> bool:
        replica = server.mesh()["replicas"][0]
        return bool(replica["healthy"]) and replica["stages"][1]["pid"] not in (None, victim)

    wait_until(serving_again, 120, "the replica serving again with a new stage process", poll_s=0.5)
    again = c.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0,
                                 extra_body={"ignore_eos": True}).choices[0].text
    assert again == whole
