"""A model's text back into OpenAI ``tool_calls``: one parser per tool-call format.

Contract:
- ``PARSERS`` names the formats (vLLM's ``--tool-call-parser`` names):
  ``hermes`` (Hermes, Qwen 2.5/3, and the format stagemesh writes into
  templates without their own: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``),
  ``llama3_json`` (Llama 3.1+: a JSON object ``{"name": ..., "parameters": {...}}``,
  optionally after ``<|python_tag|>``, several separated by ``;``) and
  ``mistral`` (``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``).
- ``parser.parse(text)`` returns ``(content, calls)``: the text outside the calls
  (None when there is none) and each call as a ``ToolCall``; text that does not
  parse as calls is all content (no call is invented or lost silently).
- ``parser.may_start_call(text)``: whether streamed text could still be (or is)
  a tool call, so the stream holds it back instead of sending it as content.
- ``pick_parser(flag, chat_template)``: the flag when given, else the format
  the model's chat template writes, else ``hermes``.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)
    id: str = ""

    @staticmethod
    def new(name: str, arguments: Any) -> ToolCall:
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        return ToolCall(name, text, f"call_{uuid.uuid4().hex[:24]}")

    def to_json(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out = {"index": index, **out}
        return out


class ToolParser(Protocol):
    marker: str

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]: ...

    def may_start_call(self, text: str) -> bool: ...


def _call(obj: Any, args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall.new(obj["name"], args)


def _content(text: str) -> str | None:
    return text.strip() or None


def _may_start(text: str, marker: str) -> bool:
    head = text.lstrip()
    return head.startswith(marker) or marker.startswith(head)


class HermesParser:
    marker = "<tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.marker not in text:
            return text, []
        calls = []
        for body in self._CALL.findall(text):
            try:
                call = _call(json.loads(body), "arguments")
            except json.JSONDecodeError:
                call = None
            if call is None:
                return text, []  # not a well-formed call: the client gets the text as it is
            calls.append(call)
        return _content(text[:text.index(self.marker)]), calls

    def may_start_call(self, text: str) -> bool:
        return _may_start(text, self.marker)


class Llama3JsonParser:
    marker = "{"
    _TAG = "<|python_tag|>"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix(self._TAG).strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        decoder = json.JSONDecoder()
        rest = body
        while rest:
            try:
                obj, end = decoder.raw_decode(rest)
            except json.JSONDecodeError:
                return text, []
            call = _call(obj, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            rest = rest[end:].strip().removeprefix(";").strip()
        return None, calls

    def may_start_call(self, text: str) -> bool:
        head = text.lstrip()
        return _may_start(head, self._TAG) or head.startswith("{") or not head


class MistralParser:
    marker = "[TOOL_CALLS]"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.marker not in text:
            return text, []
        head, _, body = text.partition(self.marker)
        try:
            items = json.loads(body.strip())
        except json.JSONDecodeError:
            return text, []
        items = items if isinstance(items, list) else [items]
        calls = [_call(item, "arguments") for item in items]
        if not calls or any(c is None for c in calls):
            return text, []
        return _content(head), [c for c in calls if c is not None]

    def may_start_call(self, text: str) -> bool:
        return _may_start(text, self.marker)


PARSERS: dict[str, ToolParser] = {"hermes": HermesParser(), "llama3_json": Llama3JsonParser(),
                                  "mistral": MistralParser()}


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
