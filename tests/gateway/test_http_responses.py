"""OpenAI's Responses API through the real ``openai`` SDK (and raw HTTP), against the gateway over a fake stage:
the translation into the chat endpoint's request, the typed events, function calls, and the refusals of what a
stateless server cannot honour, before anything reaches a stage."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from .conftest import MODEL

WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city",
           "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}}
ASK = "What is the weather in Paris?"


def _chat_prompt(server, stage, body: dict) -> list[int]:
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, **body}, timeout=20)
    assert r.status_code == 200, r.text
    return list(stage.requests[-1].prompt_token_ids)


def _events(response: httpx.Response) -> list[dict]:
    out = []
    for block in response.text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        data = json.loads(lines["data"])
        assert data["type"] == lines["event"]
        out.append(data)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


def test_response_is_the_chat_endpoints_generation(client, server, stage):
    r = client.responses.create(model=MODEL, instructions="Be brief.", input=ASK, max_output_tokens=50)
    assert r.object == "response" and r.status == "completed" and r.id.startswith("resp_") and r.store is False
    assert r.output_text == "Hello there!"
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    sent = list(stage.requests[-1].prompt_token_ids)
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (len(sent), 4, len(sent) + 4)
    assert stage.requests[-1].max_tokens == 50
    assert sent == _chat_prompt(server, stage, {"messages": [{"role": "system", "content": "Be brief."},
                                                             {"role": "user", "content": ASK}]})


def test_stream_events_and_the_sdks_stream_helper(client, server, stage, healthy_mesh):
    r = httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, "input": ASK, "stream": True}, timeout=20)
    events = _events(r)
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Hello there!"
    assert events[-1]["response"]["output"] == [events[-2]["item"]] and events[-1]["response"]["usage"]
    with client.responses.stream(model=MODEL, input=ASK) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == "Hello there!"


def test_input_items_and_sampling_fields(client, server, stage):
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": ASK}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]},
             {"role": "user", "content": "And tomorrow?"}]
    client.responses.create(model=MODEL, input=items, temperature=0.25, top_p=0.5)
    sampling = stage.requests[-1].sampling
    assert (sampling.temperature, sampling.top_p) == (0.25, 0.5)
    sent = list(stage.requests[-1].prompt_token_ids)
    assert sent == _chat_prompt(server, stage, {"messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": ASK},
        {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "And tomorrow?"}]})


def test_max_output_tokens_makes_it_incomplete(client):
    r = client.responses.create(model=MODEL, input=ASK, max_output_tokens=2)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == "Hello there"


def test_forced_function_call_and_the_round_trip(client, stage, tokenizer):
    stage.script.reply_ids = tokenizer.encode('{"city": "Paris"}', add_special_tokens=False)
    r = client.responses.create(model=MODEL, input=ASK, tools=[WEATHER],
                                tool_choice={"type": "function", "name": "get_weather"})
    assert stage.requests[-1].sampling.grammar  # the chat endpoint's constrained decoding
    (call,) = r.output
    assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "get_weather", {"city": "Paris"})
    assert call.call_id.startswith("call_") and r.status == "completed"
    stage.script.reply_ids = tokenizer.encode("It is sunny.", add_special_tokens=False)
    history = [{"role": "user", "content": ASK}, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees, sunny"}]
    answer = client.responses.create(model=MODEL, input=history, tools=[WEATHER])
    assert answer.output_text == "It is sunny."
    rendered = tokenizer.decode(list(stage.requests[-1].prompt_token_ids))
    assert '"city": "Paris"' in rendered and "18 degrees, sunny" in rendered


def test_streamed_call_arguments_add_up(server, stage, tokenizer, healthy_mesh):
    stage.script.reply_ids = tokenizer.encode('[{"name": "get_weather", "parameters": {"city": "Paris"}}]',
                                              add_special_tokens=False)
    r = httpx.post(f"{server.url}/v1/responses", timeout=20, json={
        "model": MODEL, "input": ASK, "tools": [WEATHER], "tool_choice": "required", "stream": True})
    events = _events(r)
    added = next(e for e in events if e["type"] == "response.output_item.added")["item"]
    assert added["type"] == "function_call" and added["name"] == "get_weather" and added["arguments"] == ""
    pieces = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert len(pieces) > 1 and "".join(pieces) == done["arguments"] and json.loads(done["arguments"]) == {
        "city": "Paris"}
    assert events[-1]["type"] == "response.completed"
    assert events[-1]["response"]["output"][0]["call_id"] == added["call_id"]


def test_codex_request_shape_namespaces_and_web_search(server, stage, tokenizer, healthy_mesh):
    """The fields Codex CLI 0.171 sends (captured against a bare endpoint): a namespace of functions comes back
    as its own name and namespace; web_search is not offered (nothing searches here)."""
    stage.script.reply_ids = tokenizer.encode('[{"name": "agents__close_agent", "parameters": {"target": "a1"}}]',
                                              add_special_tokens=False)
    close = {"type": "function", "name": "close_agent", "strict": False,
             "parameters": {"type": "object", "properties": {"target": {"type": "string"}}, "required": ["target"],
                            "additionalProperties": False}}
    body = {"model": MODEL, "stream": False, "store": False, "include": ["reasoning.encrypted_content"],
            "reasoning": {"summary": "auto"}, "prompt_cache_key": "session-1", "client_metadata": {"x": "y"},
            "parallel_tool_calls": True, "tool_choice": "required",
            "input": [{"type": "message", "id": "msg_1", "role": "developer",
                       "content": [{"type": "input_text", "text": "You are a coding agent."}]},
                      {"type": "message", "id": "msg_2", "role": "user",
                       "content": [{"type": "input_text", "text": "Close agent a1."}]}],
            "tools": [{"type": "namespace", "name": "agents", "description": "Agents", "tools": [close]},
                      {"type": "web_search", "external_web_access": False}]}
    r = httpx.post(f"{server.url}/v1/responses", json=body, timeout=20)
    assert r.status_code == 200, r.text
    (call,) = r.json()["output"]
    assert (call["namespace"], call["name"], json.loads(call["arguments"])) == ("agents", "close_agent",
                                                                                 {"target": "a1"})
    rendered = tokenizer.decode(list(stage.requests[-1].prompt_token_ids))
    assert "agents__close_agent" in rendered and "web_search" not in rendered


def test_text_format_is_structured_output(client, stage, tokenizer):
    stage.script.reply_ids = tokenizer.encode('{"ok": true}', add_special_tokens=False)
    schema = {"type": "object", "required": ["ok"], "properties": {"ok": {"type": "boolean"}},
              "additionalProperties": False}
    r = client.responses.create(model=MODEL, input=ASK, text={"format": {"type": "json_schema", "name": "answer",
                                                                         "schema": schema, "strict": True}})
    assert stage.requests[-1].sampling.grammar and json.loads(r.output_text) == {"ok": True}


def test_input_tokens_is_the_rendered_prompt(client, server, stage, healthy_mesh):
    client.responses.create(model=MODEL, instructions="Be brief.", input=ASK, tools=[WEATHER])
    r = httpx.post(f"{server.url}/v1/responses/input_tokens", timeout=20,
                   json={"model": MODEL, "instructions": "Be brief.", "input": ASK, "tools": [WEATHER]})
    assert r.json() == {"object": "response.input_tokens", "input_tokens": len(stage.requests[-1].prompt_token_ids)}


@pytest.mark.parametrize("body, param", [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"input": [{"type": "function_call_output", "call_id": "call_1", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "computer_call", "id": "c"}]}, "input[0].type"),
    ({"tools": [{"type": "file_search", "vector_store_ids": []}]}, "tools[0].type"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_time"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"temperature": 3}, "temperature"),
    ({"max_output_tokens": 4000}, "max_output_tokens"),
    ({"input": "word " * 2100}, "input"),
    ({"mirostat": 5}, "mirostat"),
])
def test_bad_input_is_a_400_naming_the_field_and_reaches_no_stage(server, stage, healthy_mesh, body, param):
    r = httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, "input": ASK, **body}, timeout=20)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert param.split("[")[0] in error["message"], error
    assert stage.requests == []


def test_failure_mid_stream_is_an_error_event_then_failed(server, stage, healthy_mesh):
    stage.script.fail_after_tokens = 2
    r = httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, "input": ASK, "stream": True}, timeout=20)
    events = _events(r)
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-1]["response"]["status"] == "failed" and events[-1]["response"]["error"]["message"]


def test_unknown_model_is_openais_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="gpt-x", input=ASK)
    assert e.value.body["param"] == "model"


def test_prompt_cache_key_keeps_a_conversation_on_one_replica(client, stages, healthy_mesh):
    healthy_mesh.ports[:] = [s.port for s in stages]
    try:
        for _ in range(4):
            client.responses.create(model=MODEL, input=ASK, prompt_cache_key="conversation-7")
        assert sorted(len(s.servicer.requests) for s in stages) == [0, 4]
        for _ in range(4):
            client.responses.create(model=MODEL, input=ASK)  # without a key: least outstanding, ties in turn
        assert sorted(len(s.servicer.requests) for s in stages) == [2, 6]
    finally:
        healthy_mesh.ports[:] = [stages[0].port]
