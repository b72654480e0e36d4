"""Streamed tool calls: fed any split of a reply, the incremental parser gives what the whole-text parser gives.

Each text is fed split at every position, character by character and token by token (SmolLM2's tokenizer); the
content deltas and each call's name and argument pieces, put together, must equal ``fmt.parse(text)``.
"""

from __future__ import annotations

import json

import pytest

from gateway.chat.tool_output import ToolStream
from gateway.chat.tools import tool_plan
from gateway.parsing.tool_call_stream import ArgumentsDelta, CallStart, ContentDelta, ToolCallStream
from gateway.parsing.tool_parsers import FORCED, PARSERS, ToolFormat

from .test_tools import WEATHER, chat

NESTED = '{"city": "Pa}ri\\"s {", "opts": {"days": [1, {"x": "]"}], "note": "a\\\\b"}, "n": null}'
TEXTS = {
    "hermes": [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',  # one call
        f'<tool_call>{{"name": "a", "arguments": {NESTED}}}</tool_call>\n'
        '<tool_call>{"arguments": {"q": 1}, "name": "b"}</tool_call>',  # two calls, arguments before the name
        'Let me check.\n\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>',
        "It is sunny in Paris, 18 C <tool> a < b.",  # no call (and a partial-looking marker)
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": [1, 2]}"}</tool_call>',  # arguments as a JSON string
        '<tool_call>{"name": "f"}',  # no arguments, no closing tag
        '<tool_call>{"name": 3, "arguments": {}}</tool_call>',  # not a call: content
        "<tool_call>[1, 2]</tool_call> ok",  # not a call: content
    ],
    "llama3_json": [
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
        f'{{"name": "a", "parameters": {NESTED}}}; {{"name": "b", "parameters": {{"s": ";"}}}}',
        '  \n{"name": "f", "arguments": {"k": "v"}}',
        "The answer is {not json}",
        "{oops",
        "<|python_tag|>plain text",
    ],
    "mistral": [
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        f'[TOOL_CALLS][{{"name": "a", "arguments": {NESTED}}}, {{"name": "b", "arguments": {{}}}}]',
        'Sure thing. [TOOL_CALLS] {"name": "f", "arguments": {"x": [1, "]"]}}',
        "No tools needed [TOOL.",
        "[TOOL_CALLS] nope",
        '[TOOL_CALLS] []',
    ],
    "required": [
        '[{"name":"get_weather","parameters":{"city":"Paris","unit":"celsius"}}]',
        f'[{{"name":"a","parameters":{NESTED}}},{{"name":"b","parameters":{{}}}}]',
    ],
}
CASES = [(name, text) for name, texts in TEXTS.items() for text in texts]


def _format(name: str) -> ToolFormat:
    return FORCED if name == "required" else PARSERS[name]


def _streamed(fmt: ToolFormat, pieces: list[str]) -> tuple[str | None, list[tuple[str, str]]]:
    stream = ToolCallStream(fmt)
    events = [e for piece in pieces for e in stream.feed(piece)] + stream.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls: list[list[str]] = []
    for e in events:
        if isinstance(e, CallStart):
            assert e.index == len(calls) and e.id.startswith("call_")  # increasing indexes, one start each
            calls.append([e.name, ""])
        elif isinstance(e, ArgumentsDelta):
            assert e.index == len(calls) - 1 and e.text  # pieces of the call started last
            calls[e.index][1] += e.text
    assert stream.complete == bool(calls)
    return content or None, [(name, args) for name, args in calls]


def _whole(fmt: ToolFormat, text: str) -> tuple[str | None, list[tuple[str, str]]]:
    content, calls = fmt.parse(text)
    return content or None, [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize("name, text", CASES)
def test_every_split_streams_what_the_whole_text_parses_to(name, text, tokenizer):
    fmt = _format(name)
    expected = _whole(fmt, text)
    for cut in range(len(text) + 1):
        assert _streamed(fmt, [text[:cut], text[cut:]]) == expected, cut
    assert _streamed(fmt, list(text)) == expected
    ids = tokenizer.encode(text, add_special_tokens=False)
    tokens = [tokenizer.decode(ids[:i + 1]) for i in range(len(ids))]
    pieces = [b[len(a):] for a, b in zip(["", *tokens], tokens, strict=False)]
    assert "".join(pieces) == text
    assert _streamed(fmt, pieces) == expected


def test_well_formed_calls_parse_with_arguments_as_written():
    content, calls = PARSERS["hermes"].parse(TEXTS["hermes"][1])
    assert content is None and [c.name for c in calls] == ["a", "b"]
    assert calls[0].arguments == NESTED and json.loads(calls[0].arguments)["opts"]["days"][1] == {"x": "]"}
    assert _whole(PARSERS["hermes"], TEXTS["hermes"][2]) == ("Let me check.", [("get_weather", '{"city": "Oslo"}')])
    assert _whole(PARSERS["hermes"], TEXTS["hermes"][5]) == (None, [("f", "{}")])
    for name, text in [("hermes", TEXTS["hermes"][6]), ("mistral", "[TOOL_CALLS] []"), ("llama3_json", "{oops")]:
        assert _whole(PARSERS[name], text) == (text, [])  # not calls: all content


def test_content_streams_at_once_and_a_call_starts_when_its_name_is_complete():
    stream = ToolCallStream(PARSERS["hermes"])
    assert stream.feed("The weather ") == [ContentDelta("The weather")]  # trailing whitespace waits
    assert stream.feed("is fine <tool") == [ContentDelta(" is fine")]  # so does what may open a call
    assert stream.feed('_call>{"name": "get_wea') == []
    [start] = stream.feed('ther", ')
    assert isinstance(start, CallStart) and (start.index, start.name) == (0, "get_weather")
    assert stream.feed('"arguments": {"ci') == [ArgumentsDelta(0, '{"ci')]
    assert stream.feed('ty": "Oslo"') == [ArgumentsDelta(0, 'ty": "Oslo"')]
    assert stream.feed("}}</tool_call>") == [ArgumentsDelta(0, "}")]
    assert stream.finish() == [] and stream.complete


def test_a_call_cut_short_is_not_complete():
    stream = ToolCallStream(PARSERS["mistral"])
    events = stream.feed('[TOOL_CALLS] [{"name": "f", "arguments": {"a": ')
    assert [type(e) for e in events] == [CallStart, ArgumentsDelta]
    assert stream.finish() == [] and not stream.complete


def _openai(stream: ToolStream, pieces: list[str], reason: str) -> tuple[list[dict], str | None]:
    deltas = [d for piece in pieces for d in stream.feed(piece)]
    last, finish = stream.finish(reason)
    return deltas + last, finish


@pytest.mark.parametrize("mode", ["auto", "required"])
def test_tool_stream_sends_openai_deltas_and_finishes_with_tool_calls(mode):
    text = ('Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>' if mode == "auto"
            else '[{"name":"get_weather","parameters":{"city":"Rome"}}]')
    plan = tool_plan(chat(tools=[WEATHER], tool_choice=mode))
    deltas, finish = _openai(ToolStream(plan, PARSERS["hermes"]), [text[i:i + 3] for i in range(0, len(text), 3)],
                             "stop")
    assert finish == "tool_calls"
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    first = calls[0]
    assert first["index"] == 0 and first["id"].startswith("call_") and first["type"] == "function"
    assert first["function"] == {"name": "get_weather", "arguments": ""}
    assert all(set(c) == {"index", "function"} and set(c["function"]) == {"arguments"} for c in calls[1:])
    assert len(calls) > 3  # the arguments came in pieces
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Rome"}'.replace(
        " ", "" if mode == "required" else " ")
    assert "".join(d.get("content", "") for d in deltas) == ("Checking." if mode == "auto" else "")


def test_tool_stream_without_a_call_is_plain_content():
    plan = tool_plan(chat(tools=[WEATHER]))
    deltas, finish = _openai(ToolStream(plan, PARSERS["hermes"]), ["It is", " sunny", " <", "3"], "stop")
    assert finish == "stop" and "".join(d["content"] for d in deltas) == "It is sunny <3"
