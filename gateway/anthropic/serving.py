"""``POST /v1/messages``: a Messages request run by the chat core, answered as Anthropic does.

Contract: ``AnthropicServing(core).messages(req)`` translates the request
(``gateway.anthropic.translate``), has the chat core plan it, run it and read the turn back with its reasoning
(``gateway.chat.core``), and answers a ``message`` object (``message_json``) or, streamed, Anthropic's
server-sent events (``message_start``, ``ping``, the ``content_block_*`` events, ``message_delta``,
``message_stop``). Every check fails before anything is generated, with Anthropic's envelope and the field
named in this API's terms; a failure after the stream started is an ``error`` event, and the stream ends.
A ``max_tokens`` above the room the context leaves generates to the end of the context, ending with
``stop_reason: "model_context_window_exceeded"``; a prompt that fills the context itself is an
``invalid_request_error`` naming both numbers. A forced tool call cut by ``max_tokens`` is a ``tool_use``
block whose ``input`` holds what was written (``stop_reason: "max_tokens"``), never text.
``count_tokens(req)`` is ``{"input_tokens": n}``, the prompt as the same request would render it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse

from gateway.chat.core import ChatCore
from gateway.chat.plan import ChatPlan
from gateway.chat.translation import Translated
from gateway.chat.turn import (
    ArgumentsDelta,
    CallStart,
    ContentDelta,
    ReasoningDelta,
    Reply,
    Turn,
    TurnEvent,
    TurnStep,
    partial_object,
)
from gateway.http.errors import APIError
from gateway.http.sse import SSEResponse, new_id, sse, stream_response

from . import errors
from .protocol import CountTokensRequest, MessagesRequest
from .translate import to_chat

log = logging.getLogger("stagemesh.gateway")


def _event(kind: str, data: dict[str, Any]) -> str:
    return sse(data, kind)


# "context": the context filled before max_tokens did (run_chat's fill_context), Anthropic's own stop reason.
STOP_REASONS = {"end": "end_turn", "stop_string": "stop_sequence", "length": "max_tokens", "tool_calls": "tool_use",
                "context": "model_context_window_exceeded"}


def message_json(message_id: str, model: str, turn: Turn) -> dict[str, Any]:
    """The unstreamed ``message``: ``content`` blocks in order (``thinking`` when the template reasons, ``text``,
    then one ``tool_use`` per call, its ``input`` the parsed arguments), ``stop_reason`` (``STOP_REASONS``;
    ``stop_sequence`` set when a stop string ended the turn) and ``usage`` (``input_tokens``, ``output_tokens``)."""
    content: list[dict[str, Any]] = []
    if turn.reasoning is not None:
        content.append({"type": "thinking", "thinking": turn.reasoning, "signature": ""})
    if turn.content:
        content.append({"type": "text", "text": turn.content})
    # A forced call cut by max_tokens is still a tool_use block (stop_reason max_tokens): its input is what the
    # arguments hold so far, as Anthropic's SDKs read a cut input_json stream.
    content += [{"type": "tool_use", "id": c.id, "name": c.name, "input": partial_object(c.arguments)}
                for c in turn.calls]
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": STOP_REASONS[turn.end.stop], "stop_sequence": turn.end.stop_string,
            "usage": _usage(turn.end.prompt_tokens, turn.end.cached_tokens, turn.end.completion_tokens)}


def _usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict[str, int]:
    """Anthropic's usage: ``input_tokens`` are the prompt positions computed, ``cache_read_input_tokens`` those
    restored from the prefix cache (their sum is the prompt, as Anthropic counts it); nothing is ever written
    to a cache on request (``cache_control`` is accepted: the cache is automatic), so creation is 0."""
    return {"input_tokens": prompt_tokens - cached_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached_tokens, "output_tokens": output_tokens}


class _Blocks:
    """The stream's content blocks: one open at a time, each opened by its first delta.

    A block is ``content_block_start``, its ``content_block_delta``s (``thinking_delta``, ``text_delta``, or
    ``input_json_delta`` whose ``partial_json`` pieces add up to the call's input) and ``content_block_stop``.
    """

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # "thinking", "text" or a call's id

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def start(self, key: str, block: dict[str, Any]) -> list[str]:
        out = self.close()
        self.index += 1
        self.open = key
        return out + [_event("content_block_start",
                                {"type": "content_block_start", "index": self.index, "content_block": block})]

    def delta(self, delta: dict[str, Any]) -> str:
        return _event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def feed(self, event: TurnEvent) -> list[str]:
        if isinstance(event, ReasoningDelta):
            opened = [] if self.open == "thinking" else self.start("thinking", {"type": "thinking", "thinking": "",
                                                                               "signature": ""})
            return opened + [self.delta({"type": "thinking_delta", "thinking": event.text})]
        if isinstance(event, ContentDelta):
            opened = [] if self.open == "text" else self.start("text", {"type": "text", "text": ""})
            return opened + [self.delta({"type": "text_delta", "text": event.text})]
        if isinstance(event, CallStart):
            return self.start(event.id, {"type": "tool_use", "id": event.id, "name": event.name, "input": {}})
        if isinstance(event, ArgumentsDelta):
            return [self.delta({"type": "input_json_delta", "partial_json": event.text})]
        return []


class AnthropicServing:
    def __init__(self, core: ChatCore) -> None:
        self._core = core

    def _translate(self, req: CountTokensRequest) -> Translated:
        return to_chat(req, thinking_switch=self._core.server.thinking_switch)

    def count_tokens(self, req: CountTokensRequest) -> dict[str, int]:
        translated = self._translate(req)
        plan = translated.named(lambda: self._core.plan(translated.chat))
        return {"input_tokens": len(plan.prompt)}

    async def messages(self, req: MessagesRequest) -> JSONResponse | SSEResponse:
        arrived = time.monotonic()
        translated = self._translate(req)
        plan = translated.named(lambda: self._core.plan(translated.chat, arrived))
        message_id = new_id("msg")
        # Anthropic's API takes a max_tokens above the room the context leaves: it generates to the end of the
        # context and says so (Claude Code asks for 32,000 on every request, whatever the model's context).
        reply = translated.named(lambda: self._core.run_chat(plan, message_id, split_reasoning=True,
                                                             fill_context=True))
        if not plan.settings.stream:
            [turn] = await reply.whole()
            return JSONResponse(message_json(message_id, plan.model, turn))
        await reply.start()
        return stream_response(self._stream(message_id, plan, reply))

    async def _stream(self, message_id: str, plan: ChatPlan, reply: Reply) -> AsyncIterator[str]:
        """Anthropic's events, each ``event: <type>`` and its ``data:``: ``message_start`` (the message with empty
        content and the input tokens), ``ping``, the blocks (``_Blocks``), then ``message_delta``
        (``stop_reason``, ``stop_sequence``, ``usage.output_tokens``) and ``message_stop``."""
        blocks = _Blocks()
        steps = reply.steps()
        try:
            # The first step (awaited already by reply.start()) says how much of the prompt the cache restored.
            first = await anext(steps)
            start: dict[str, Any] = {
                "id": message_id, "type": "message", "role": "assistant", "model": plan.model, "content": [],
                "stop_reason": None, "stop_sequence": None,
                "usage": _usage(len(plan.prompt), first.cached_tokens, 0)}
            yield _event("message_start", {"type": "message_start", "message": start})
            yield _event("ping", {"type": "ping"})
            async for step in _chained(first, steps):
                for event in step.events:
                    for out in blocks.feed(event):
                        yield out
                if step.end is not None:
                    for out in blocks.close():
                        yield out
                    end = step.end
                    yield _event("message_delta", {
                        "type": "message_delta",
                        "delta": {"stop_reason": STOP_REASONS[end.stop], "stop_sequence": end.stop_string},
                        "usage": _usage(end.prompt_tokens, end.cached_tokens, end.completion_tokens)})
                    yield _event("message_stop", {"type": "message_stop"})
        except APIError as e:
            log.warning("stream %s failed after it started: %s", message_id, e.message)
            yield _event("error", errors.event(e))
        finally:
            await reply.aclose()


async def _chained(first: TurnStep, rest: AsyncIterator[TurnStep]) -> AsyncIterator[TurnStep]:
    yield first
    async for step in rest:
        yield step
