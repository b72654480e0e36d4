"""A choice's generated text as content and tool calls, whole or as it streams, by the request's ``ToolPlan``.

Contract:
- ``final_message(text, finish, plan, fmt)`` -> ``(content, tool_calls, finish)``: a forced call
  (``required`` / ``named``) is read from its constrained JSON; with ``auto`` the tool-call format ``fmt``
  finds the calls in the text; any whole call makes the finish reason ``tool_calls``. Forced output cut by the
  token budget (finish ``length``) is still calls, never content: each call begun, the last with its
  arguments as far as they were written, the finish reason staying ``length`` (what the stream sent, too).
  Without calls the text stays content.
- ``ToolStream(plan, fmt)`` does the same incrementally for one streamed choice: ``events(text)`` returns the
  typed events to send now (``ContentDelta``, ``CallStart``, ``ArgumentsDelta``) and ``finish_events(reason)``
  the last ones and the finish reason (``tool_calls`` when calls were made whole); ``gateway.chat.turn`` reads
  every reply through it. A streamed call's ``arguments`` pieces add up to the non-streamed call's.
  ``feed`` / ``finish`` give the same as OpenAI's chat deltas (``openai_delta``: the tool-call shape of the
  chat request, OpenAI's).
"""

from __future__ import annotations

from typing import Any

from gateway.parsing.reasoning import ReasoningDelta
from gateway.parsing.tool_call_stream import ArgumentsDelta, CallStart, ContentDelta, Event, ToolCallStream
from gateway.parsing.tool_parsers import FORCED, ToolCall, ToolFormat, new_call_id

from .tools import ToolPlan


def final_message(text: str, finish: str | None, plan: ToolPlan,
                  fmt: ToolFormat) -> tuple[str | None, list[ToolCall], str | None]:
    if plan.mode in ("named", "required"):
        calls = plan.forced_calls(text)
        if calls:
            return None, calls, "tool_calls"
        if finish == "length":
            cut = _cut_calls(text, plan)
            if cut:
                return None, cut, finish
        return text, [], finish
    if plan.mode == "auto":
        content, calls = fmt.parse(text)
        if calls:
            return content, calls, "tool_calls"
    return text, [], finish


def _cut_calls(text: str, plan: ToolPlan) -> list[ToolCall]:
    """The calls a forced output cut short had begun, read as its stream reads them (``ToolStream``), so the
    ids aside, an unstreamed reply holds what the stream sent."""
    stream = ToolStream(plan, FORCED)
    calls: list[list[str]] = []  # [id, name, arguments so far]
    for event in [*stream.events(text), *stream.finish_events("length")[0]]:
        if isinstance(event, CallStart):
            calls.append([event.id, event.name, ""])
        elif isinstance(event, ArgumentsDelta) and calls:
            calls[-1][2] += event.text
    return [ToolCall(name, arguments, call_id) for call_id, name, arguments in calls]


def openai_delta(event: Event | ReasoningDelta) -> dict[str, Any]:
    """An event as OpenAI's chat ``delta`` (its chat has no reasoning field: reasoning text is content)."""
    if isinstance(event, (ContentDelta, ReasoningDelta)):
        return {"content": event.text}
    if isinstance(event, CallStart):
        return {"tool_calls": [{"index": event.index, "id": event.id, "type": "function",
                                "function": {"name": event.name, "arguments": ""}}]}
    return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}


class ToolStream:
    """Every call streams: a first delta with its ``index``, ``id``, ``type``, ``function.name`` and
    ``arguments: ""``, then ``function.arguments`` pieces as the model writes them. A ``named`` call's
    arguments are the whole output; ``required`` output is read as the ``FORCED`` format and ``auto`` output
    as ``fmt``, by ``gateway.parsing.tool_call_stream``, which streams the text before any call as content."""

    def __init__(self, plan: ToolPlan, fmt: ToolFormat) -> None:
        self._plan = plan
        self._parser: ToolCallStream | None = None
        self._named = ""  # a named call's arguments so far
        self._named_id = new_call_id()
        if plan.mode == "auto":
            self._parser = ToolCallStream(fmt)
        elif plan.mode == "required":
            self._parser = ToolCallStream(FORCED)

    def feed(self, text: str) -> list[dict[str, Any]]:
        return [openai_delta(e) for e in self.events(text)]

    def finish(self, reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        events, reason = self.finish_events(reason)
        return [openai_delta(e) for e in events], reason

    def events(self, text: str) -> list[Event]:
        """``feed``'s deltas as typed events (``gateway.parsing.tool_call_stream``), for the APIs shaped otherwise."""
        if not text:
            return []
        if self._parser is not None:
            return self._parser.feed(text)
        if self._plan.mode == "named" and self._plan.name is not None:
            first = not self._named
            self._named += text
            delta = ArgumentsDelta(0, text)
            return [CallStart(0, self._named_id, self._plan.name), delta] if first else [delta]
        return [ContentDelta(text)]

    def finish_events(self, reason: str | None) -> tuple[list[Event], str | None]:
        if self._parser is not None:
            return self._parser.finish(), "tool_calls" if self._parser.complete else reason
        if self._named:
            return [], "tool_calls" if self._plan.forced_calls(self._named) else reason
        return [], reason
