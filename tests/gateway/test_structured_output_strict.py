"""Strict JSON Schema semantics by default, and a forced call cut short reported as a call in each API.

The grammar a request compiles is checked against the model's real tokenizer with llguidance's own matcher (the
last stage's), so "refused" means the stage's mask would refuse those tokens; the APIs run over the fake stage.
"""

from __future__ import annotations

import json

import httpx
import llguidance
import llguidance.hf
import pytest
from llguidance import LLMatcher

from gateway.chat.grammar import grammar_for, json_schema_grammar, strict_schema
from gateway.chat.tools import tool_plan
from gateway.openai.schemas import ChatCompletionRequest

from .conftest import MODEL

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CITY = {"type": "object", "required": ["city"],
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": CITY}}


@pytest.fixture(scope="module")
def accepts(tokenizer):
    """``accepts(grammar, text)``: the last stage's matcher takes ``text``'s tokens and may end there."""
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))

    def check(grammar: str, text: str) -> bool:
        matcher = LLMatcher(lltok, grammar, log_level=0)
        ids = tokenizer.encode(text, add_special_tokens=False)
        return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()
    return check


def test_an_object_that_declares_properties_takes_no_others(accepts):
    strict, lax = json_schema_grammar(CITY, "s"), json_schema_grammar(CITY, "s", strict=False)
    for grammar in (strict, lax):
        assert accepts(grammar, '{"city":"Paris"}') and accepts(grammar, '{"city":"Paris","unit":"celsius"}')
        assert not accepts(grammar, '{"unit":"celsius","city":"Paris"}')  # declared order, either way
        assert not accepts(grammar, '{"unit":"celsius"}')  # required, either way
    assert not accepts(strict, '{"city":"Paris","country":"France"}')
    assert accepts(lax, '{"city":"Paris","country":"France"}')  # JSON Schema's own default


def test_strict_closes_nested_objects_defs_and_tuples_but_not_what_it_must_not():
    schema = {"type": "object", "properties": {
        "home": {"$ref": "#/$defs/place"}, "trips": {"type": "array", "items": {"properties": {"to": {}}}},
        "pair": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]},
        "free": {"type": "object"}, "open": {"properties": {"a": {}}, "additionalProperties": True},
        "either": {"anyOf": [{"properties": {"x": {}}}, {"type": "null"}]},
        "both": {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]},
        "unlike": {"not": {"properties": {"z": {}}}}},
        "$defs": {"place": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    out = strict_schema(schema)
    assert out["additionalProperties"] is False and "additionalProperties" not in schema  # a copy
    props = out["properties"]
    assert out["$defs"]["place"]["additionalProperties"] is False
    assert props["trips"]["items"]["additionalProperties"] is False
    assert props["pair"]["items"] is False
    assert "additionalProperties" not in props["free"]  # declares nothing: JSON mode's any object
    assert props["open"]["additionalProperties"] is True  # the schema's own word stands
    assert props["either"]["anyOf"][0]["additionalProperties"] is False
    # Closing each member of an allOf would make each refuse the other's key, so nothing would match.
    assert all("additionalProperties" not in member for member in props["both"]["allOf"])
    assert props["unlike"]["not"] == {"properties": {"z": {}}}  # closing a negation would widen it


def test_every_schema_source_is_strict_and_the_switch_loosens_them(accepts):
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": CITY}}
    extra = '{"city":"Paris","country":"France"}'
    for request in (ChatCompletionRequest(messages=ASK, response_format=fmt),
                    ChatCompletionRequest(messages=ASK, guided_json=CITY)):
        assert not accepts(grammar_for(request), extra)
        assert accepts(grammar_for(request, strict=False), extra)
    # A request's own strict: true holds under a lax server; its false does not loosen a strict one.
    asked = {"type": "json_schema", "json_schema": {"name": "w", "schema": CITY, "strict": True}}
    assert not accepts(grammar_for(ChatCompletionRequest(messages=ASK, response_format=asked), strict=False), extra)
    loose = {"type": "json_schema", "json_schema": {"name": "w", "schema": CITY, "strict": False}}
    assert not accepts(grammar_for(ChatCompletionRequest(messages=ASK, response_format=loose)), extra)
    assert accepts(grammar_for(ChatCompletionRequest(messages=ASK, response_format={"type": "json_object"})),
                   extra)
    strict_tool = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    assert tool_plan(ChatCompletionRequest(messages=ASK, tools=[strict_tool], tool_choice="required")).strict
    assert not tool_plan(ChatCompletionRequest(messages=ASK, tools=[WEATHER], tool_choice="required")).strict


@pytest.mark.parametrize("tool_choice", ["named", "required"])
def test_forced_calls_are_strict_at_the_stage(server, stage, accepts, tool_choice, healthy_mesh):
    choice = {"type": "function", "function": {"name": "get_weather"}} if tool_choice == "named" else "required"
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=20,
                   json={"model": MODEL, "messages": ASK, "tools": [WEATHER], "tool_choice": choice})
    assert r.status_code == 200, r.text
    grammar = stage.requests[-1].sampling.grammar
    whole, extra = '{"city":"Paris"}', '{"city":"Paris","country":"France"}'
    if tool_choice == "required":
        whole, extra = (f'[{{"name":"get_weather","parameters":{args}}}]' for args in (whole, extra))
    assert accepts(grammar, whole) and not accepts(grammar, extra)


def test_a_request_strict_that_is_not_a_boolean_is_a_400(server, stage, healthy_mesh):
    tool = {"type": "function", "function": {**WEATHER["function"], "strict": "yes"}}
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=20,
                   json={"model": MODEL, "messages": ASK, "tools": [tool]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].function.strict"
    assert stage.requests == []


CUT = '{"city": "Paris, France", "unit": "celsius"}'


def test_a_forced_chat_call_cut_by_max_tokens_is_a_call_with_finish_length(server, stage, tokenizer, healthy_mesh):
    stage.script.reply_ids = tokenizer.encode(CUT, add_special_tokens=False)
    written = tokenizer.decode(stage.script.reply_ids[:6])
    body = {"model": MODEL, "messages": ASK, "tools": [WEATHER], "max_tokens": 6,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    choice = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=20).json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": written}
    chunks = [json.loads(line[6:]) for line in httpx.post(
        f"{server.url}/v1/chat/completions", json={**body, "stream": True}, timeout=20).text.splitlines()
        if line.startswith("data: {")]
    pieces = [d["function"].get("arguments", "") for c in chunks for d in c["choices"][0]["delta"].get("tool_calls", [])]
    assert "".join(pieces) == written and chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_a_required_call_cut_short_keeps_its_name_and_arguments_so_far(server, stage, tokenizer, healthy_mesh):
    stage.script.reply_ids = tokenizer.encode(f'[{{"name": "get_weather", "parameters": {CUT}}}]',
                                              add_special_tokens=False)
    body = {"model": MODEL, "messages": ASK, "tools": [WEATHER], "max_tokens": 14, "tool_choice": "required"}
    choice = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=20).json()["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "length" and call["function"]["name"] == "get_weather"
    assert CUT.startswith(call["function"]["arguments"]) and call["function"]["arguments"]


def test_a_forced_responses_call_cut_short_is_an_incomplete_function_call(server, stage, tokenizer, healthy_mesh):
    stage.script.reply_ids = tokenizer.encode(CUT, add_special_tokens=False)
    tool = {"type": "function", "name": "get_weather", "parameters": CITY}
    body = {"model": MODEL, "input": ASK, "tools": [tool], "max_output_tokens": 6,
            "tool_choice": {"type": "function", "name": "get_weather"}}
    r = httpx.post(f"{server.url}/v1/responses", json=body, timeout=20).json()
    assert r["status"] == "incomplete" and r["incomplete_details"] == {"reason": "max_output_tokens"}
    (item,) = r["output"]
    assert item["type"] == "function_call" and item["status"] == "incomplete"
    assert item["arguments"] == tokenizer.decode(stage.script.reply_ids[:6])
    text = httpx.post(f"{server.url}/v1/responses", json={**body, "stream": True}, timeout=20).text
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1]["type"] == "response.incomplete"
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [(i["type"], i["status"]) for i in done] == [("function_call", "incomplete")]
