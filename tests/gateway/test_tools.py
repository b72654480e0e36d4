"""Tool calling in the gateway: parsers read each format back, plans check the request, templates get the tools."""

from __future__ import annotations

import json

import pytest

from gateway.chat.tools import tool_plan
from gateway.http.errors import APIError
from gateway.openai.schemas import ChatCompletionRequest
from gateway.parsing.tool_parsers import PARSERS, pick_parser

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "required": ["city"],
                                                           "properties": {"city": {"type": "string"}}}}}


def chat(**kw):
    return ChatCompletionRequest(messages=[{"role": "user", "content": "Weather in Paris?"}], **kw)


@pytest.mark.parametrize("parser, text, content", [
    ("hermes", 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "Sure."),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', None),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]', None),
])
def test_each_parser_reads_its_format(parser, text, content):
    got, calls = PARSERS[parser].parse(text)
    assert got == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert calls[0].id.startswith("call_")


@pytest.mark.parametrize("parser", sorted(PARSERS))
def test_text_that_is_not_a_call_stays_content(parser):
    for text in ("The weather is fine.", '<tool_call>{"name": 3}</tool_call>', "[TOOL_CALLS] nope", "{oops"):
        content, calls = PARSERS[parser].parse(text)
        assert calls == [] and content == text


def test_parser_is_picked_from_the_flag_or_the_template():
    assert pick_parser(None, "{{ '[TOOL_CALLS]' }}") == "mistral"
    assert pick_parser(None, "<|python_tag|>") == "llama3_json"
    assert pick_parser(None, "{{ messages }}") == "hermes"
    assert pick_parser("mistral", "<tool_call>") == "mistral"
    with pytest.raises(ValueError, match="--tool-call-parser"):
        pick_parser("nope", None)


@pytest.mark.parametrize("kw, param", [
    ({"tool_choice": "auto"}, "tool_choice"),  # without tools: OpenAI and vLLM refuse it
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
])
def test_tool_requests_are_checked(kw, param):
    with pytest.raises(APIError) as e:
        tool_plan(chat(**kw))
    assert e.value.status == 400 and e.value.param == param


def test_forced_plans_constrain_to_arguments_or_a_list_of_calls():
    named = tool_plan(chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    assert named.forced_schema() == WEATHER["function"]["parameters"]
    [call] = named.forced_calls('{"city":"Paris"}')
    assert (call.name, call.arguments) == ("get_weather", '{"city":"Paris"}')  # as the model wrote it
    assert named.forced_calls('{"city":"Pa') == []  # cut short
    required = tool_plan(chat(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False))
    assert required.forced_schema()["maxItems"] == 1
    calls = required.forced_calls('[{"name": "get_weather", "parameters": {"city": "Rome"}}]')
    assert [c.name for c in calls] == ["get_weather"]
    assert tool_plan(chat(tools=[WEATHER])).mode == "auto"
    assert tool_plan(chat(tools=[WEATHER], tool_choice="none")).forced_schema() is None


def test_tools_and_history_reach_a_template_without_tool_support(client, stage, tokenizer):
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=history, tools=[WEATHER])
    prompt = tokenizer.decode(list(stage.requests[-1].prompt_token_ids))
    assert "<tools>" in prompt and '"get_weather"' in prompt  # described in the system message (Hermes)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in prompt
