"""One generated assistant turn read as reasoning, text and tool calls: what the non-chat APIs shape.

Contract:
- ``TurnReader(plan, serving)`` knows how a chat plan's reply reads: its tools (``ToolPlan``), the server's
  tool-call format, and whether the chat template writes reasoning (``gateway.parsing.reasoning``).
- ``reader.stream(events)`` turns one choice's ``ChoiceEvent``s into ``ReasoningDelta``, ``ContentDelta``,
  ``CallStart``, ``ArgumentsDelta`` as they come and ends with one ``TurnEnd``; ``reader.whole(events)``
  collects a ``Turn``. Both read calls as the chat endpoint does (``gateway.chat.tool_output``) and count usage in
  the gateway's metrics once the turn has ended.
- ``first_awaited(events)`` waits for the first event before a stream starts, so a mesh that cannot serve
  still gets a proper HTTP status.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Literal

from gateway.openai.serving import ChatPlan, OpenAIServing
from gateway.parsing.reasoning import ReasoningSplitter, opens_reasoning, split_reasoning, template_reasons
from gateway.parsing.tool_call_stream import ArgumentsDelta, CallStart, ContentDelta
from gateway.parsing.tool_parsers import ToolCall

from .generation import ChoiceEvent
from .tool_output import ToolStream, final_message

Stop = Literal["end", "stop_string", "length", "tool_calls"]
_PROMPT_TAIL_TOKENS = 8  # enough to hold a template's opening <think> and the newline after it


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class TurnEnd:
    """How the turn ended. ``stop`` is ``end`` (EOS or a stop token), ``stop_string`` (one of the request's stop
    strings, named in ``stop_string``), ``length`` (the token budget) or ``tool_calls`` (whole calls were made)."""

    stop: Stop
    stop_string: str | None
    prompt_tokens: int
    completion_tokens: int


TurnEvent = ReasoningDelta | ContentDelta | CallStart | ArgumentsDelta | TurnEnd


@dataclass(frozen=True)
class Turn:
    reasoning: str | None
    content: str | None
    calls: list[ToolCall]
    end: TurnEnd


def _stop(finish: str | None, stop_string: str | None) -> Stop:
    if finish == "tool_calls":
        return "tool_calls"
    if finish == "length":
        return "length"
    return "stop_string" if stop_string is not None else "end"


async def first_awaited(events: AsyncGenerator[ChoiceEvent, None]) -> AsyncGenerator[ChoiceEvent, None]:
    try:
        first = await anext(events)
    except BaseException:
        await events.aclose()
        raise

    async def chained() -> AsyncGenerator[ChoiceEvent, None]:
        async with contextlib.aclosing(events):
            yield first
            async for event in events:
                yield event

    return chained()


class TurnReader:
    """How one chat plan's reply reads; the rendered prompt may itself open the reasoning (``opens_reasoning``)."""

    def __init__(self, plan: ChatPlan, serving: OpenAIServing) -> None:
        self._plan = plan
        self._serving = serving
        self._reasons = template_reasons(serving.chat_template)
        tail = serving.tokenizer.decode(list(plan.prompt[-_PROMPT_TAIL_TOKENS:])) if self._reasons else ""
        self._inside = self._reasons and opens_reasoning(tail)

    def _ended(self, finish: str | None, last: ChoiceEvent) -> TurnEnd:
        self._serving.record_usage(last.prompt_tokens, last.completion_tokens)
        return TurnEnd(_stop(finish, last.stop_string), last.stop_string, last.prompt_tokens,
                       last.completion_tokens)

    async def whole(self, events: AsyncGenerator[ChoiceEvent, None]) -> Turn:
        """The whole turn, its calls read as an unstreamed chat completion reads them (``final_message``)."""
        texts: list[str] = []
        last: ChoiceEvent | None = None
        async with contextlib.aclosing(events):
            async for event in events:
                texts.append(event.text)
                last = event
        assert last is not None and last.finish_reason  # run_choices ends every choice with its finish reason
        reasoning, text = split_reasoning("".join(texts), self._inside) if self._reasons else (None, "".join(texts))
        content, calls, finish = final_message(text, last.finish_reason, self._plan.tools, self._serving.tool_parser)
        return Turn(reasoning, content or None, calls, self._ended(finish, last))

    async def stream(self, events: AsyncGenerator[ChoiceEvent, None]) -> AsyncGenerator[TurnEvent, None]:
        """The turn's events as they come, calls parsed incrementally as a streamed chat completion parses them
        (``ToolStream``), ending with one ``TurnEnd``."""
        tools = ToolStream(self._plan.tools, self._serving.tool_parser)
        splitter = ReasoningSplitter(self._inside) if self._reasons else None
        async with contextlib.aclosing(events):
            async for event in events:
                pieces = [("text", event.text)] if splitter is None else splitter.feed(event.text)
                if event.finish_reason and splitter is not None:
                    pieces += splitter.finish()
                for kind, text in pieces:
                    if kind == "reasoning":
                        yield ReasoningDelta(text)
                    else:
                        for out in tools.events(text):
                            yield out
                if event.finish_reason:
                    last, finish = tools.finish_events(event.finish_reason)
                    for out in last:
                        yield out
                    yield self._ended(finish, event)
                    return
