"""Bad requests get 4xx OpenAI envelopes, never 422 or 500."""

from __future__ import annotations

import httpx
import openai
import pytest

from .conftest import MODEL

CHAT = [{"role": "user", "content": "hi"}]


def envelope(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=CHAT)
    assert e.value.body["param"] == "model" and "gpt-4o" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_empty_model_means_the_served_one(server, stage):
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "", "prompt": "x", "max_tokens": 1})
    assert r.status_code == 200 and r.json()["model"] == MODEL


@pytest.mark.parametrize("body", ["not json{{{", "[]", "42", "null", '"text"', '{"prompt": 3}',
                                  '{"prompt": "x", "n": "two"}', '{"prompt": "x", "temperature": "hot"}', "",
                                  '{"prompt": "x"', b"\xff\xfe"])
def test_malformed_bodies_are_400(server, stage, body):
    r = httpx.post(f"{server.url}/v1/completions", content=body, headers={"content-type": "application/json"})
    envelope(r, 400)


def test_wrong_content_type_is_400(server, stage):
    err = envelope(httpx.post(f"{server.url}/v1/completions", content='{"prompt": "x"}',
                              headers={"content-type": "text/plain"}), 400)
    assert "application/json" in err["message"]


def test_field_errors_name_the_field(client, server, stage):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, temperature=3)
    assert e.value.body["param"] == "temperature" and "[0, 2]" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, logprobs=True, top_logprobs=21)
    assert e.value.body["param"] == "top_logprobs" and "between 0 and 20" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", logprobs=21)
    assert e.value.body["param"] == "logprobs"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, presence_penalty=2.5)
    assert e.value.body["param"] == "presence_penalty" and "[-2, 2]" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, logit_bias={"99999999": 1.0})
    assert e.value.body["param"] == "logit_bias" and "out of the vocabulary" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, extra_body={"use_beam_search": True})
    assert e.value.body["param"] == "use_beam_search"
    err = envelope(httpx.post(f"{server.url}/v1/chat/completions",
                              json={"messages": CHAT, "mirostat": 1}), 400)
    assert err["param"] == "mirostat"
    err = envelope(httpx.post(f"{server.url}/v1/chat/completions",
                              json={"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}), 400)
    assert err["param"] == "messages[0].content"
    err = envelope(httpx.post(f"{server.url}/v1/chat/completions",
                              json={"messages": [{"role": "wizard", "content": "x"}]}), 400)
    assert err["param"] == "messages[0].role"
    assert not stage.requests  # nothing reached the stage


def test_prompt_too_long_is_400_with_the_numbers(client, stage):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[5] * 2048)
    assert "2048" in e.value.body["message"] and e.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[5] * 100, max_tokens=2000)
    msg = e.value.body["message"]
    assert "2048" in msg and "2100" in msg and "2000" in msg and e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=[49152])  # out of vocabulary
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="")
    assert not stage.requests


def test_unknown_route_and_method(server):
    envelope(httpx.get(f"{server.url}/v1/nothing"), 404)
    envelope(httpx.get(f"{server.url}/v1/completions"), 405)
