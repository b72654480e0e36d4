"""Anthropic's Messages API through the real ``anthropic`` SDK (and raw HTTP), against the gateway over a fake stage:
the translation into the chat endpoint's request, the event sequence, tools, thinking, and every refusal in
Anthropic's envelope before anything reaches a stage."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from gateway.app import GatewayConfig, create_app
from gateway.chat.defaults import OpenAIDefaults

from .conftest import API_KEY, MODEL
from .fakes import AppServer

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"name": "get_weather", "description": "The current weather in a city",
           "input_schema": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}}


@pytest.fixture
def claude(server, stage, healthy_mesh) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=20)


def _prompt(stage) -> list[int]:
    return list(stage.requests[-1].prompt_token_ids)


def _chat_prompt(server, stage, body: dict) -> list[int]:
    """The prompt the chat endpoint sends the stage for ``body``: the reference for every translation."""
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, **body}, timeout=20)
    assert r.status_code == 200, r.text
    return _prompt(stage)


def _events(response: httpx.Response) -> list[tuple[str, dict]]:
    out = []
    for block in response.text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        data = json.loads(lines["data"])
        assert data["type"] == lines["event"]  # Anthropic names every event twice
        out.append((lines["event"], data))
    return out


def test_message_is_the_chat_endpoints_generation(claude, server, stage, tokenizer):
    r = claude.messages.create(model=MODEL, max_tokens=50, system="Be brief.", messages=ASK)
    assert r.type == "message" and r.role == "assistant" and r.model == MODEL and r.id.startswith("msg_")
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == "Hello there!"
    assert (r.stop_reason, r.stop_sequence) == ("end_turn", None)
    sent = _prompt(stage)
    assert (r.usage.input_tokens, r.usage.output_tokens) == (len(sent), 4)  # EOS counts, as in chat
    assert stage.requests[-1].max_tokens == 50
    chat = _chat_prompt(server, stage, {"messages": [{"role": "system", "content": "Be brief."}, *ASK]})
    assert sent == chat


def test_stream_has_anthropics_event_sequence(server, stage, healthy_mesh):
    r = httpx.post(f"{server.url}/v1/messages?beta=true", timeout=20, headers={"anthropic-version": "2023-06-01"},
                   json={"model": MODEL, "max_tokens": 50, "messages": ASK, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _events(r)
    kinds = [k for k, _ in events]
    assert kinds == ["message_start", "ping", "content_block_start", "content_block_delta", "content_block_delta",
                     "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] == len(stage.requests[-1].prompt_token_ids)
    assert events[2][1]["content_block"] == {"type": "text", "text": ""}
    assert "".join(d["delta"]["text"] for k, d in events if k == "content_block_delta") == "Hello there!"
    assert events[-2][1]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert events[-2][1]["usage"]["output_tokens"] == 4


def test_sdk_stream_helper_builds_the_same_message(claude):
    with claude.messages.stream(model=MODEL, max_tokens=50, messages=ASK) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "Hello there!" and final.content[0].text == text and final.stop_reason == "end_turn"


def test_sampling_fields_from_the_body_and_stop_sequences(claude, stage):
    r = claude.messages.create(model=MODEL, max_tokens=50, messages=ASK, stop_sequences=["there"],
                               extra_body={"temperature": 0.25, "top_p": 0.5, "top_k": 7})
    sampling = stage.requests[-1].sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (0.25, 0.5, 7)
    assert r.content[0].text == "Hello " and (r.stop_reason, r.stop_sequence) == ("stop_sequence", "there")
    r = claude.messages.create(model=MODEL, max_tokens=2, messages=ASK)
    assert r.content[0].text == "Hello there" and r.stop_reason == "max_tokens"


def test_forced_tool_call_and_the_round_trip(claude, stage, tokenizer):
    stage.script.reply_ids = tokenizer.encode('{"city": "Paris"}', add_special_tokens=False)
    r = claude.messages.create(model=MODEL, max_tokens=50, messages=ASK, tools=[WEATHER],
                               tool_choice={"type": "tool", "name": "get_weather"})
    assert stage.requests[-1].sampling.grammar  # the chat endpoint's constrained decoding
    (call,) = r.content
    assert (call.type, call.name, call.input, r.stop_reason) == ("tool_use", "get_weather", {"city": "Paris"},
                                                                  "tool_use")
    stage.script.reply_ids = tokenizer.encode("It is sunny.", add_special_tokens=False)
    history = [*ASK, {"role": "assistant", "content": [c.model_dump() for c in r.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                             "content": "18 degrees, sunny"}]}]
    answer = claude.messages.create(model=MODEL, max_tokens=50, messages=history, tools=[WEATHER])
    assert answer.content[0].text == "It is sunny." and answer.stop_reason == "end_turn"
    rendered = tokenizer.decode(list(stage.requests[-1].prompt_token_ids))
    assert '"city": "Paris"' in rendered and "18 degrees, sunny" in rendered  # the call and its result


def test_streamed_tool_call_sends_input_json_deltas(server, stage, tokenizer, healthy_mesh):
    stage.script.reply_ids = tokenizer.encode('[{"name": "get_weather", "parameters": {"city": "Paris"}}]',
                                              add_special_tokens=False)
    r = httpx.post(f"{server.url}/v1/messages", timeout=20, json={
        "model": MODEL, "max_tokens": 60, "messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "any"},
        "stream": True})
    events = _events(r)
    (start,) = [d for k, d in events if k == "content_block_start"]
    assert start["content_block"]["type"] == "tool_use" and start["content_block"]["name"] == "get_weather"
    pieces = [d["delta"]["partial_json"] for k, d in events if k == "content_block_delta"]
    assert len(pieces) > 1 and json.loads("".join(pieces)) == {"city": "Paris"}
    assert [d for k, d in events if k == "message_delta"][0]["delta"]["stop_reason"] == "tool_use"


def test_auto_tool_call_in_the_models_own_format(claude, stage, tokenizer):
    stage.script.reply_ids = tokenizer.encode(
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
        add_special_tokens=False)
    r = claude.messages.create(model=MODEL, max_tokens=80, messages=ASK, tools=[WEATHER])
    assert [b.type for b in r.content] == ["text", "tool_use"] and r.content[0].text == "Let me check."
    assert r.content[1].input == {"city": "Oslo"} and r.stop_reason == "tool_use"


def test_prefill_continues_the_assistants_text(claude, stage, tokenizer):
    claude.messages.create(model=MODEL, max_tokens=20,
                           messages=[*ASK, {"role": "assistant", "content": "The weather is"}])
    rendered = tokenizer.decode(list(stage.requests[-1].prompt_token_ids))
    assert rendered.endswith("The weather is")  # no end of turn: the model continues it


def test_count_tokens_is_the_rendered_prompt(claude, stage):
    claude.messages.create(model=MODEL, max_tokens=20, system="Be brief.", messages=ASK, tools=[WEATHER])
    counted = claude.messages.count_tokens(model=MODEL, system="Be brief.", messages=ASK, tools=[WEATHER])
    assert counted.input_tokens == len(stage.requests[-1].prompt_token_ids)


def test_claude_codes_request_shape_is_accepted(server, stage, healthy_mesh):
    """The fields Claude Code 2.1 sends beside the conversation (captured against a bare endpoint)."""
    body = {
        "model": MODEL, "max_tokens": 100, "stream": True, "tools": [],
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1"},
                   {"type": "text", "text": "You are brief.", "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Say hi",
                                                   "cache_control": {"type": "ephemeral"}}]}],
        "metadata": {"user_id": "{\"session_id\": \"x\"}"}, "thinking": {"type": "adaptive", "display": "omitted"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"}}
    r = httpx.post(f"{server.url}/v1/messages?beta=true", json=body, timeout=20,
                   headers={"anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14"})
    assert r.status_code == 200, r.text
    assert [k for k, _ in _events(r)][-1] == "message_stop"


def test_system_messages_between_turns_are_system_messages(claude, server, stage):
    """Claude Code 2.1 sends its environment as a message of role system after the first user message."""
    claude.messages.create(model=MODEL, max_tokens=20, messages=[
        *ASK, {"role": "system", "content": [{"type": "text", "text": "# Environment", "cache_control": None}]}])
    sent = list(stage.requests[-1].prompt_token_ids)
    assert sent == _chat_prompt(server, stage, {"messages": [*ASK, {"role": "system", "content": "# Environment"}]})


def test_structured_output_through_output_config(claude, stage, tokenizer):
    stage.script.reply_ids = tokenizer.encode('{"ok": true}', add_special_tokens=False)
    schema = {"type": "object", "required": ["ok"], "properties": {"ok": {"type": "boolean"}}}
    r = claude.messages.create(model=MODEL, max_tokens=20, messages=ASK,
                               extra_body={"output_config": {"format": {"type": "json_schema", "schema": schema}}})
    assert stage.requests[-1].sampling.grammar and json.loads(r.content[0].text) == {"ok": True}


MISSING = object()


def _refused(server, body: dict, status: int = 400) -> str:
    """The error message of ``body`` (``max_tokens`` 20 unless given; a field set to ``MISSING`` is left out)."""
    sent = {k: v for k, v in {"model": MODEL, "max_tokens": 20, **body}.items() if v is not MISSING}
    r = httpx.post(f"{server.url}/v1/messages", json=sent, timeout=20)
    assert r.status_code == status, r.text
    envelope = r.json()
    assert envelope["type"] == "error" and set(envelope["error"]) == {"type", "message"}
    if status == 400:
        assert envelope["error"]["type"] == "invalid_request_error"
    return envelope["error"]["message"]


@pytest.mark.parametrize("body, named", [
    ({"max_tokens": MISSING, "messages": ASK}, "max_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "x"}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "video", "url": "x"}]}]}, "messages[0].content[0].type"),
    ({"messages": [*ASK, {"role": "assistant", "content": "Sure."},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"}]}]},
     "messages[2].content[0].tool_use_id"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     "messages[0].content[0].type"),
    ({"messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_time"}}, "tool_choice"),
    ({"messages": ASK, "tools": [{**WEATHER, "type": "web_search_20250305"}]}, "tools[0].type"),
    ({"messages": ASK, "temperature": 3}, "temperature"),
    ({"messages": ASK, "top_p": 0}, "top_p"),
    ({"messages": ASK, "stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences"),
    ({"messages": ASK, "tools": [WEATHER, WEATHER]}, "tools"),
    ({"messages": ASK, "tools": [{**WEATHER, "input_schema": {"type": "object", "properties": {"x": {
        "type": "string", "pattern": "("}}}}], "tool_choice": {"type": "any"}}, "tools"),
    ({"messages": ASK, "mirostat": 5}, "mirostat"),
    ({"messages": ASK, "mcp_servers": [{"type": "url", "url": "http://x"}]}, "mcp_servers"),
])
def test_bad_input_is_a_400_naming_the_field_and_reaches_no_stage(server, stage, healthy_mesh, body, named):
    message = _refused(server, body)
    assert named in message, message
    assert stage.requests == []


def test_a_prompt_over_the_context_is_anthropics_error_with_the_token_counts(server, stage, healthy_mesh):
    message = _refused(server, {"max_tokens": 100, "messages": [{"role": "user", "content": "word " * 2100}]})
    assert "2048" in message and "input tokens" in message, message
    assert stage.requests == []


def _near_the_context(claude, room: int) -> list[dict]:
    """A conversation whose prompt leaves ``room`` tokens of the fake server's 2,048 (its count, then padded)."""
    words = 2048 - room - claude.messages.count_tokens(model=MODEL, messages=[
        {"role": "user", "content": ""}]).input_tokens
    messages = [{"role": "user", "content": "word" + " word" * (words - 1)}]
    assert claude.messages.count_tokens(model=MODEL, messages=messages).input_tokens == 2048 - room
    return messages


def test_max_tokens_past_the_context_generates_to_its_end_and_says_so(claude, server, stage, tokenizer):
    """Claude Code asks for 32,000 tokens whatever the model: Anthropic's API generates what the context holds
    and stops with model_context_window_exceeded, where OpenAI's endpoints keep vLLM's 400."""
    messages = _near_the_context(claude, room=6)
    stage.script.reply_ids = tokenizer.encode(" and so on" * 10, add_special_tokens=False)
    stage.script.end_with_eos = False
    r = claude.messages.create(model=MODEL, max_tokens=32000, messages=messages)
    assert stage.requests[-1].max_tokens == 6 and r.usage.output_tokens == 6
    assert r.stop_reason == "model_context_window_exceeded" and r.content[0].text
    body = {"model": MODEL, "max_tokens": 32000, "messages": messages, "stream": True}
    events = _events(httpx.post(f"{server.url}/v1/messages", json=body, timeout=20))
    (delta,) = [d for k, d in events if k == "message_delta"]
    assert delta["delta"]["stop_reason"] == "model_context_window_exceeded"
    assert delta["usage"]["output_tokens"] == 6 and [k for k, _ in events][-1] == "message_stop"
    # A budget that fits ends as its own: max_tokens, not the context.
    assert claude.messages.create(model=MODEL, max_tokens=5, messages=messages).stop_reason == "max_tokens"
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=20,
                   json={"model": MODEL, "max_tokens": 32000, "messages": messages})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_a_prompt_that_fills_the_context_is_refused_naming_both_numbers(claude, server, stage):
    messages = _near_the_context(claude, room=0)
    message = _refused(server, {"max_tokens": 32000, "messages": messages})
    assert "2048" in message and "2048 input tokens" in message, message
    assert stage.requests == []


def test_a_forced_call_cut_by_max_tokens_is_a_partial_tool_use_block(claude, server, stage, tokenizer):
    """Never passed off as text: the block, its input as far as it was written, and stop_reason max_tokens."""
    stage.script.reply_ids = tokenizer.encode('{"city": "Paris, France", "unit": "celsius"}',
                                              add_special_tokens=False)
    r = claude.messages.create(model=MODEL, max_tokens=6, messages=ASK, tools=[WEATHER],
                               tool_choice={"type": "tool", "name": "get_weather"})
    (call,) = r.content
    assert call.type == "tool_use" and call.name == "get_weather" and r.stop_reason == "max_tokens"
    assert set(call.input) == {"city"} and "Paris, France".startswith(call.input["city"])
    body = {"model": MODEL, "max_tokens": 6, "messages": ASK, "tools": [WEATHER], "stream": True,
            "tool_choice": {"type": "tool", "name": "get_weather"}}
    events = _events(httpx.post(f"{server.url}/v1/messages", json=body, timeout=20))
    (start,) = [d for k, d in events if k == "content_block_start"]
    assert start["content_block"]["type"] == "tool_use"
    pieces = "".join(d["delta"]["partial_json"] for k, d in events if k == "content_block_delta")
    assert pieces == tokenizer.decode(tokenizer.encode('{"city": "Paris, France", "unit": "celsius"}',
                                                       add_special_tokens=False)[:6])
    assert [d for k, d in events if k == "message_delta"][0]["delta"]["stop_reason"] == "max_tokens"


def test_unknown_model_is_not_found_error(server, stage, healthy_mesh):
    r = httpx.post(f"{server.url}/v1/messages", json={"model": "claude-x", "max_tokens": 5, "messages": ASK})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_x_api_key_and_bearer_both_authenticate(keyed_server, stage, healthy_mesh):
    good = anthropic.Anthropic(base_url=keyed_server.url, api_key=API_KEY, max_retries=0, timeout=20)
    assert good.messages.create(model=MODEL, max_tokens=20, messages=ASK).content[0].text == "Hello there!"
    bearer = anthropic.Anthropic(base_url=keyed_server.url, auth_token=API_KEY, max_retries=0, timeout=20)
    assert bearer.messages.create(model=MODEL, max_tokens=20, messages=ASK).stop_reason == "end_turn"
    bad = anthropic.Anthropic(base_url=keyed_server.url, api_key="wrong", max_retries=0, timeout=20)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model=MODEL, max_tokens=20, messages=ASK)
    assert e.value.body["error"]["type"] == "authentication_error" and "x-api-key" in e.value.body["error"]["message"]


def test_failure_mid_stream_is_an_error_event(server, stage, tokenizer, healthy_mesh):
    stage.script.fail_after_tokens = 2
    r = httpx.post(f"{server.url}/v1/messages", timeout=20,
                   json={"model": MODEL, "max_tokens": 50, "messages": ASK, "stream": True})
    events = _events(r)
    assert events[-1][0] == "error" and events[-1][1]["error"]["type"] == "overloaded_error"
    assert "message_stop" not in [k for k, _ in events]


THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}"
    "{% endif %}")


@pytest.fixture(scope="module")
def thinking_server(mesh, tokenizer, eos_ids):
    config = GatewayConfig(served_model_name=MODEL, max_model_len=2048,
                           openai=OpenAIDefaults(chat_template=THINKING_TEMPLATE))
    s = AppServer(create_app(config, mesh=mesh, tokenizer=tokenizer, eos_token_ids=eos_ids)).start()
    yield s
    s.stop()


def test_a_reasoning_template_gives_thinking_blocks(thinking_server, stage, tokenizer, healthy_mesh):
    stage.script.reply_ids = tokenizer.encode("Paris is in France.</think>\n\nHello there!", add_special_tokens=False)
    claude = anthropic.Anthropic(base_url=thinking_server.url, api_key="unused", max_retries=0, timeout=20)
    r = claude.messages.create(model=MODEL, max_tokens=50, messages=ASK)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in r.content] == [
        ("thinking", "Paris is in France."), ("text", "Hello there!")]
    with claude.messages.stream(model=MODEL, max_tokens=50, messages=ASK) as stream:
        streamed = stream.get_final_message()
    assert [b.model_dump(exclude={"signature"}) for b in streamed.content] == [
        b.model_dump(exclude={"signature"}) for b in r.content]


def test_thinking_disabled_switches_the_templates_reasoning_off(thinking_server, stage, tokenizer, healthy_mesh):
    claude = anthropic.Anthropic(base_url=thinking_server.url, api_key="unused", max_retries=0, timeout=20)
    r = claude.messages.create(model=MODEL, max_tokens=50, messages=ASK, thinking={"type": "disabled"})
    assert tokenizer.decode(list(stage.requests[-1].prompt_token_ids)).endswith("</think>\n\n")
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == "Hello there!"


def test_metrics_count_the_new_endpoints_and_their_tokens(claude, server, stage):
    def scrape() -> dict[str, float]:
        rows = httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines()
        return {r.rsplit(" ", 1)[0]: float(r.rsplit(" ", 1)[1]) for r in rows if r and not r.startswith("#")}

    before = scrape()
    claude.messages.create(model=MODEL, max_tokens=50, messages=ASK)
    httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, "input": "Hi"}, timeout=20)
    after = scrape()
    for endpoint in ("/v1/messages", "/v1/responses"):
        key = f'stagemesh_gateway_requests_total{{endpoint="{endpoint}",status="200"}}'
        assert after[key] == before.get(key, 0) + 1
    assert after["stagemesh_gateway_generation_tokens_total"] == before["stagemesh_gateway_generation_tokens_total"] + 8
