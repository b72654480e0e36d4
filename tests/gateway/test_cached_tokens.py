"""Cached prompt tokens, as the stage reports them, in every API's own usage field, streamed and not.

The fake stage says how many prompt positions its prefix cache restored (``GenerateResponse.cached_tokens``,
the real entry stage's figure: tests/test_scheduler_prefix_cache.py checks it); each API reports that figure.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from .conftest import MODEL

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture
def cached(stage):
    stage.script.cached_tokens = 32
    return 32


def _sse(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def test_chat_and_completions_report_prompt_tokens_details(server, stage, cached, healthy_mesh):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5)
    assert r.usage.prompt_tokens_details.cached_tokens == cached
    assert r.usage.prompt_tokens == len(stage.requests[-1].prompt_token_ids)  # the whole prompt, as OpenAI counts
    stream = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, stream=True,
                                            stream_options={"include_usage": True})
    assert [c.usage for c in stream][-1].prompt_tokens_details.cached_tokens == cached
    # n choices of one prompt count its cached positions once, as its prompt tokens are.
    done = client.completions.create(model=MODEL, prompt=["Hello", "Hi"], max_tokens=3, n=2)
    assert done.usage.prompt_tokens_details.cached_tokens == 2 * cached


def test_nothing_cached_is_zero(server, stage, healthy_mesh):
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": ASK}, timeout=20).json()
    assert r["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def test_responses_report_input_tokens_details(server, stage, cached, healthy_mesh):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    r = client.responses.create(model=MODEL, input=ASK, max_output_tokens=5)
    assert r.usage.input_tokens_details.cached_tokens == cached
    with client.responses.stream(model=MODEL, input=ASK, max_output_tokens=5) as stream:
        final = stream.get_final_response()
    assert final.usage.input_tokens_details.cached_tokens == cached


def test_messages_report_cache_reads_beside_the_computed_input(server, stage, cached, healthy_mesh):
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    r = claude.messages.create(model=MODEL, max_tokens=5, messages=ASK,
                               system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}])
    prompt = len(stage.requests[-1].prompt_token_ids)
    # Anthropic's input_tokens are what was computed: with the cache reads, the whole prompt.
    assert (r.usage.input_tokens, r.usage.cache_read_input_tokens) == (prompt - cached, cached)
    assert r.usage.cache_creation_input_tokens == 0
    with claude.messages.stream(model=MODEL, max_tokens=5, messages=ASK) as stream:
        events = list(stream)
        final = stream.get_final_message()
    prompt = len(stage.requests[-1].prompt_token_ids)
    start = next(e for e in events if e.type == "message_start")
    assert (start.message.usage.input_tokens, start.message.usage.cache_read_input_tokens) == (prompt - cached, cached)
    assert (final.usage.input_tokens, final.usage.cache_read_input_tokens) == (prompt - cached, cached)
