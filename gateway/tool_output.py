"""A chat choice's generated text as OpenAI's message or stream deltas when tools are in play.

Contract:
- ``final_message(text, finish, plan, parser)`` -> ``(content, tool_calls, finish)``:
  a forced call (``required`` / ``named``) is read from its constrained JSON;
  with ``auto`` the parser finds the calls in the text; any call makes the
  finish reason ``tool_calls``. Without calls the text stays content.
- ``ToolStream(plan, parser)`` does the same incrementally for one streamed
  choice: ``feed(text)`` returns the deltas to send now and ``finish(reason)``
  the last ones and the finish reason. A ``named`` call streams its argument
  text as it comes (after a first delta with the call's id and name); ``auto``
  streams content at once unless it may be a call (the parser's marker), in
  which case it holds the text and sends the parsed calls at the end;
  ``required`` sends its calls at the end.
"""

from __future__ import annotations

from typing import Any

from .tool_parsers import ToolCall, ToolParser
from .tools import ToolPlan


def final_message(text: str, finish: str | None, plan: ToolPlan,
                  parser: ToolParser) -> tuple[str | None, list[ToolCall], str | None]:
    if plan.mode in ("named", "required"):
        calls = plan.forced_calls(text)
        return (None, calls, "tool_calls") if calls else (text, [], finish)
    if plan.mode == "auto":
        content, calls = parser.parse(text)
        if calls:
            return content, calls, "tool_calls"
    return text, [], finish


class ToolStream:
    def __init__(self, plan: ToolPlan, parser: ToolParser) -> None:
        self._plan = plan
        self._parser = parser
        self._held = ""
        self._streaming_content = plan.mode == "none"
        self._named: ToolCall | None = None

    def feed(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        if self._streaming_content:
            return [{"content": text}]
        if self._plan.mode == "named" and self._plan.name is not None:
            out = []
            if self._named is None:
                self._named = ToolCall.new(self._plan.name, "")
                out.append({"tool_calls": [self._named.to_json(index=0)]})
            self._held += text
            out.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
            return out
        self._held += text
        if self._plan.mode == "auto" and not self._parser.may_start_call(self._held):
            self._streaming_content = True
            held, self._held = self._held, ""
            return [{"content": held}]
        return []

    def finish(self, reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        if self._streaming_content:
            return [], reason
        if self._named is not None:
            return [], "tool_calls" if self._plan.forced_calls(self._held) else reason
        content, calls, reason = final_message(self._held, reason, self._plan, self._parser)
        out: list[dict[str, Any]] = []
        if content:
            out.append({"content": content})
        if calls:
            out.append({"tool_calls": [c.to_json(index=i) for i, c in enumerate(calls)]})
        return out, reason
