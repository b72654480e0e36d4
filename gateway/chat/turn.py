"""A reply read back once, choice by choice: text, reasoning, tool calls and how it ended, for every API to encode.

Contract:
- ``Reply(jobs, events, reading, observer, split_reasoning=...)`` reads a run's ``ChoiceEvent``s once, as the
  plan's ``Reading`` says (its tools, the tool-call format, whether the template writes reasoning).
  ``steps()`` gives a ``TurnStep`` per event: its choice's new ``ReasoningDelta``, ``ContentDelta``,
  ``CallStart`` and ``ArgumentsDelta`` events (calls parsed as they stream, ``gateway.chat.tool_output``),
  the ``TurnEnd`` once it ended, and the logprobs of its tokens. ``whole()`` is each choice's ``Turn``, its
  calls read from the whole text. Reasoning is split off only with ``split_reasoning`` and a template that
  writes it; otherwise the model's text is all content.
- ``start()`` waits for the first event (``gateway.chat.generation.first_awaited``); usage is counted in the
  observer once every choice has ended; ``aclose()`` cancels what still runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from gateway.parsing.reasoning import ReasoningDelta, ReasoningSplitter, split_reasoning
from gateway.parsing.partial_json import partial_object
from gateway.parsing.tool_call_stream import ArgumentsDelta, CallStart, ContentDelta
from gateway.parsing.tool_parsers import ToolCall

from .generation import ChoiceEvent, ChoiceJob, TokenLogprobs, first_awaited
from .plan import Reading
from .tool_output import ToolStream, final_message

__all__ = ["ArgumentsDelta", "CallStart", "ContentDelta", "ReasoningDelta", "Reply", "Stop",
           "TokenLogprobs", "Turn", "TurnEnd", "TurnEvent", "TurnStep", "UsageObserver", "partial_object"]

Stop = Literal["end", "stop_string", "length", "context", "tool_calls"]


TurnEvent = ReasoningDelta | ContentDelta | CallStart | ArgumentsDelta


@dataclass(frozen=True)
class TurnEnd:
    """How one choice ended. ``finish_reason`` is OpenAI's word (``stop``, ``length``, ``tool_calls``);
    ``stop_string`` names the request's stop string that ended it, if one did."""

    index: int
    finish_reason: str
    stop_string: str | None
    prompt_tokens: int
    completion_tokens: int
    context_full: bool = False  # ended at the end of the context before the request's own budget
    cached_tokens: int = 0  # prompt positions restored from the prefix cache, not computed (the APIs' cached tokens)

    @property
    def stop(self) -> Stop:
        """``end`` (EOS or a stop token), ``stop_string``, ``length`` (the token budget), ``context`` (the
        context's end, only under ``run_chat(fill_context=True)``) or ``tool_calls``."""
        if self.finish_reason == "tool_calls":
            return "tool_calls"
        if self.finish_reason == "length":
            return "context" if self.context_full else "length"
        return "stop_string" if self.stop_string is not None else "end"


@dataclass(frozen=True)
class TurnStep:
    """What one event added to its choice: the events to send, its end (once), its tokens' logprobs."""

    index: int
    events: tuple[TurnEvent, ...]
    end: TurnEnd | None
    logprobs: tuple[TokenLogprobs, ...]
    completion_tokens: int  # so far
    cached_tokens: int = 0  # prompt positions restored from the prefix cache (known from the first event)

    @property
    def text(self) -> str:
        """The step's content text (with the tools off: all the text the event brought)."""
        return "".join(e.text for e in self.events if isinstance(e, ContentDelta))


@dataclass(frozen=True)
class Turn:
    index: int
    reasoning: str | None
    content: str | None
    calls: list[ToolCall]
    end: TurnEnd
    logprobs: tuple[TokenLogprobs, ...] = ()


class UsageObserver(Protocol):
    def usage(self, prompt_tokens: int, generation_tokens: int) -> None: ...


class _ChoiceReader:
    """One choice's text as turn events: reasoning split off first (when read), then calls parsed from the rest."""

    def __init__(self, reading: Reading, split: bool) -> None:
        self._tools = ToolStream(reading.tools, reading.tool_format)
        self._splitter = ReasoningSplitter(reading.inside) if split else None

    def step(self, event: ChoiceEvent) -> TurnStep:
        splitter = self._splitter
        pieces = [("text", event.text)] if splitter is None else splitter.feed(event.text)
        if event.finish_reason and splitter is not None:
            pieces += splitter.finish()
        out: list[TurnEvent] = []
        for kind, text in pieces:
            if kind == "reasoning":
                out.append(ReasoningDelta(text))
            else:
                out += self._tools.events(text)
        end = None
        if event.finish_reason:
            last, finish = self._tools.finish_events(event.finish_reason)
            out += last
            end = TurnEnd(event.index, finish or event.finish_reason, event.stop_string, event.prompt_tokens,
                          event.completion_tokens, event.context_full, event.cached_tokens)
        return TurnStep(event.index, tuple(out), end, event.logprobs, event.completion_tokens, event.cached_tokens)


def whole_turn(index: int, text: str, last: ChoiceEvent, logprobs: Sequence[TokenLogprobs], reading: Reading,
               split: bool) -> Turn:
    """A choice's whole text read as an unstreamed reply reads it: reasoning split off, then the calls
    (``final_message``)."""
    reasoning, rest = split_reasoning(text, reading.inside) if split else (None, text)
    content, calls, finish = final_message(rest, last.finish_reason, reading.tools, reading.tool_format)
    end = TurnEnd(index, finish or "stop", last.stop_string, last.prompt_tokens, last.completion_tokens,
                  last.context_full, last.cached_tokens)
    return Turn(index, reasoning, content, calls, end, tuple(logprobs))


class Reply:
    def __init__(self, jobs: Sequence[ChoiceJob], events: AsyncGenerator[ChoiceEvent, None], reading: Reading,
                 observer: UsageObserver, *, split_reasoning: bool = False) -> None:
        self.jobs = tuple(jobs)
        self._events = events
        self._reading = reading
        self._observer = observer
        self._split = split_reasoning and reading.reasons
        self._stepping: AsyncGenerator[TurnStep, None] | None = None

    async def start(self) -> None:
        self._events = await first_awaited(self._events)

    async def aclose(self) -> None:
        if self._stepping is not None:
            await self._stepping.aclose()
        await self._events.aclose()

    def _ended(self, completion_tokens: int) -> None:
        self._observer.usage(sum(len(j.prompt_ids) for j in self.jobs), completion_tokens)

    def steps(self) -> AsyncGenerator[TurnStep, None]:
        self._stepping = self._steps()
        return self._stepping

    async def _steps(self) -> AsyncGenerator[TurnStep, None]:
        readers = {job.index: _ChoiceReader(self._reading, self._split) for job in self.jobs}
        completion: dict[int, int] = {}
        async with contextlib.aclosing(self._events) as events:
            async for event in events:
                step = readers[event.index].step(event)
                if step.end is not None:
                    completion[step.index] = step.end.completion_tokens
                    if len(completion) == len(self.jobs):
                        self._ended(sum(completion.values()))
                yield step

    async def whole(self) -> list[Turn]:
        """Every choice's turn, in choice order, once all have ended."""
        texts: dict[int, list[str]] = {job.index: [] for job in self.jobs}
        logprobs: dict[int, list[TokenLogprobs]] = {job.index: [] for job in self.jobs}
        last: dict[int, ChoiceEvent] = {}
        async with contextlib.aclosing(self._events) as events:
            async for event in events:
                texts[event.index].append(event.text)
                logprobs[event.index].extend(event.logprobs)
                last[event.index] = event
        # run_choices ends every choice with its finish reason
        assert all(last[j.index].finish_reason for j in self.jobs)
        self._ended(sum(last[j.index].completion_tokens for j in self.jobs))
        return [whole_turn(j.index, "".join(texts[j.index]), last[j.index], logprobs[j.index], self._reading,
                           self._split) for j in self.jobs]
