"""A model's text back into OpenAI ``tool_calls``: what each tool-call format looks like, and the whole-text parser.

Contract:
- ``ToolFormat`` is the one description of a format, read by both the whole-text parser here and the
  streaming one (``gateway.parsing.tool_call_stream.ToolCallStream(fmt)``), so both agree on what a call is.
- ``PARSERS`` names the formats by vLLM's ``--tool-call-parser`` names (``hermes``, ``llama3_json``,
  ``mistral``); ``FORCED`` is the shape ``tool_choice: "required"`` constrains the output to
  (``gateway.chat.tools``): a JSON array of ``{"name", "parameters"}``.
- ``fmt.parse(text)`` returns ``(content, calls)``: the text before the calls (trailing whitespace dropped;
  None when nothing is left) and each call as a ``ToolCall``, its ``arguments`` the model's own JSON text of
  the arguments object. Text that does not parse as calls is all content (no call is invented or lost
  silently); text after the last call is not part of the reply.
- ``pick_parser(flag, chat_template)``: the flag when given, else the format the model's chat template
  writes, else ``hermes``.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from json.decoder import scanstring  # type: ignore[attr-defined]  # public in json.decoder, untyped
from typing import Any

_WS = " \t\n\r"
_DECODER = json.JSONDecoder()


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)
    id: str = ""

    @staticmethod
    def new(name: str, arguments: Any) -> ToolCall:
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        return ToolCall(name, text, new_call_id())

    def to_json(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out = {"index": index, **out}
        return out


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def object_members(text: str, i: int) -> tuple[list[tuple[str, Any, str]], int]:
    """The JSON object at ``text[i]`` as ``(key, value, value's raw text)`` members, and where it ends.

    Raises ValueError (json.JSONDecodeError) when it is not one well-formed object.
    """
    if not text.startswith("{", i):
        raise ValueError("not an object")
    members: list[tuple[str, Any, str]] = []
    i = skip_ws(text, i + 1)
    if text.startswith("}", i):
        return members, i + 1
    while True:
        if not text.startswith('"', i):
            raise ValueError("expected a key")
        key, i = scanstring(text, i + 1)
        i = skip_ws(text, i)
        if not text.startswith(":", i):
            raise ValueError("expected ':'")
        start = skip_ws(text, i + 1)
        value, end = _DECODER.raw_decode(text, start)
        members.append((key, value, text[start:end]))
        i = skip_ws(text, end)
        if text.startswith(",", i):
            i = skip_ws(text, i + 1)
        elif text.startswith("}", i):
            return members, i + 1
        else:
            raise ValueError("expected ',' or '}'")


ARGUMENT_KEYS = ("arguments", "parameters")  # models mix them up; every format reads either


def arguments_text(value: Any, raw: str) -> str | None:
    """A call's arguments as the JSON text of an object, or None when they are not one."""
    if isinstance(value, dict):
        return raw
    if isinstance(value, str):
        try:
            return value if isinstance(json.loads(value), dict) else None
        except json.JSONDecodeError:
            return None
    return None


def call_from_members(members: list[tuple[str, Any, str]]) -> tuple[str, str] | None:
    """``(name, arguments text)`` of a call object's members: a string ``name`` and an object of arguments
    (the first of ``arguments`` / ``parameters``; none is ``{}``); None when it is not a call."""
    name = next((v for k, v, _ in members if k == "name"), None)
    if not isinstance(name, str):
        return None
    args = next(((v, raw) for k, v, raw in members if k in ARGUMENT_KEYS), None)
    if args is None:
        return name, "{}"
    text = arguments_text(*args)
    return None if text is None else (name, text)


@dataclass(frozen=True)
class ToolFormat:
    """Where the calls open (``marker``, or the start of the text), what wraps each call (``call_open`` /
    ``call_close``), whether the calls are a JSON array, what separates them; either of ``ARGUMENT_KEYS``
    holds the arguments.

    ``parse`` gives a call's ``arguments`` exactly as a stream sends them piece by piece; a JSON string
    holding an object counts as that object's text.
    """

    name: str
    marker: str = ""  # opens the calls after any content; "" : the calls (after ``tag``) must open the text
    tag: str = ""  # optional text before calls that open the text (llama3's <|python_tag|>)
    call_open: str = ""  # before each call object (hermes; the marker is the first one)
    call_close: str = ""  # after each call object (optional at the very end)
    array: bool = False  # the calls are a JSON array (a lone object is accepted too)
    separator: str = ""  # between calls that are neither wrapped nor in an array

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.marker:
            at = text.find(self.marker)
            if at < 0:
                return text, []
            content = text[:at].rstrip() or None
            i = at if self.call_open else at + len(self.marker)
        else:
            i = skip_ws(text, 0)
            if self.tag and text.startswith(self.tag, i):
                i = skip_ws(text, i + len(self.tag))
            content = None
        try:
            calls = [ToolCall(name, args, new_call_id()) for name, args in self._calls(text, i)]
        except ValueError:
            return text, []
        return (content, calls) if calls else (text, [])

    def _calls(self, text: str, i: int) -> list[tuple[str, str]]:
        """The calls from ``text[i]`` on; ValueError when any is malformed."""
        found: list[tuple[str, str]] = []

        def one(j: int) -> int:
            members, end = object_members(text, skip_ws(text, j))
            call = call_from_members(members)
            if call is None:
                raise ValueError("not a call")
            found.append(call)
            return end

        if self.call_open:
            while (at := text.find(self.call_open, i)) >= 0:
                i = skip_ws(text, one(at + len(self.call_open)))
                if self.call_close and text.startswith(self.call_close, i):
                    i += len(self.call_close)
                elif i < len(text):
                    raise ValueError(f"expected {self.call_close}")
            return found
        if self.array and text.startswith("[", skip_ws(text, i)):
            i = skip_ws(text, skip_ws(text, i) + 1)
            while not text.startswith("]", i):
                i = skip_ws(text, one(i))
                if text.startswith(",", i):
                    i += 1
                elif not text.startswith("]", i):
                    raise ValueError("expected ',' or ']'")
            return found
        i = skip_ws(text, one(i))
        while self.separator and text.startswith(self.separator, i):
            i = skip_ws(text, one(i + len(self.separator)))
        return found


# hermes: Hermes, Qwen 2.5/3, and the format stagemesh writes into templates without their own
#   (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``);
# llama3_json: Llama 3.1+, a JSON object ``{"name": ..., "parameters": {...}}``, optionally after
#   ``<|python_tag|>``, several separated by ``;``;
# mistral: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``.
PARSERS: dict[str, ToolFormat] = {
    "hermes": ToolFormat("hermes", marker="<tool_call>", call_open="<tool_call>", call_close="</tool_call>"),
    "llama3_json": ToolFormat("llama3_json", tag="<|python_tag|>", separator=";"),
    "mistral": ToolFormat("mistral", marker="[TOOL_CALLS]", array=True),
}
FORCED = ToolFormat("required", array=True)


def pick_parser(flag: str | None, chat_template: str | None) -> str:
    if flag:
        if flag not in PARSERS:
            raise ValueError(f"--tool-call-parser {flag!r}: choose one of {', '.join(PARSERS)}")
        return flag
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "hermes"
