"""/tokenize, /detokenize and /version on a real gateway with the real tokenizer."""

from __future__ import annotations

import httpx

from stagemesh_core.settings import stagemesh_version

from .conftest import MODEL


def test_tokenize_a_prompt_and_back(server, tokenizer):
    r = httpx.post(f"{server.url}/tokenize",
                   json={"model": MODEL, "prompt": "Hello wörld 😀", "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tokenizer.encode("Hello wörld 😀", add_special_tokens=True)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 2048
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    back = httpx.post(f"{server.url}/detokenize", json={"tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": "Hello wörld 😀"}


def test_tokenize_a_chat_as_the_chat_endpoint_renders_it(server, client, stage, tokenizer):
    messages = [{"role": "user", "content": "Hi there"}]
    r = httpx.post(f"{server.url}/tokenize", json={"messages": messages})
    assert r.status_code == 200, r.text
    client.chat.completions.create(model=MODEL, messages=messages)
    assert r.json()["tokens"] == list(stage.requests[-1].prompt_token_ids)
    assert r.json()["token_strs"] is None


def test_bad_input_is_a_clear_error(server):
    r = httpx.post(f"{server.url}/detokenize", json={"tokens": [10**9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = httpx.post(f"{server.url}/tokenize", json={"model": "other", "prompt": "x"})
    assert r.status_code == 404
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": "x", "colour": 1})
    assert r.status_code == 400


def test_version(server):
    assert httpx.get(f"{server.url}/version").json() == {"version": stagemesh_version()}
