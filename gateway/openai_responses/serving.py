"""``POST /v1/responses``: a Responses request run by the chat core, answered as OpenAI does.

Contract: ``ResponsesServing(core).create(req)`` translates the request
(``gateway.openai_responses.translate``), has the chat core plan it, run it and read the turn back with its
reasoning (``gateway.chat.core``), and answers a ``response`` object whose ``output``
holds ``reasoning``, ``message`` and ``function_call`` items (``output_items``) or, streamed, OpenAI's
numbered server-sent events from ``response.created`` to ``response.completed`` (or ``response.incomplete``).
Nothing is stored: ``store`` is false in every response. Every check fails before anything is generated,
with OpenAI's envelope and the field named in this API's terms; a failure after the stream started is an
``error`` event then ``response.failed``. ``input_tokens(req)`` counts the prompt as the same request would
render it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse

from gateway.chat.core import ChatCore
from gateway.chat.plan import ChatPlan
from gateway.chat.turn import ArgumentsDelta, CallStart, ContentDelta, ReasoningDelta, Reply, Turn, TurnEnd, TurnEvent
from gateway.http.errors import APIError
from gateway.http.sse import SSEResponse, new_id, sse, stream_response

from .protocol import InputTokensRequest, ResponsesRequest
from .translate import ResponsesTranslation, to_chat

log = logging.getLogger("stagemesh.gateway")


def _usage(end: TurnEnd) -> dict[str, Any]:
    return {"input_tokens": end.prompt_tokens, "input_tokens_details": {"cached_tokens": end.cached_tokens},
            "output_tokens": end.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": end.prompt_tokens + end.completion_tokens}


class _Response:
    """What every snapshot of one response shares: its id and the request's settings, echoed.

    A finished response's ``status`` is ``completed``, or ``incomplete`` with
    ``incomplete_details.reason: "max_output_tokens"``; ``usage`` counts input and output tokens.
    """

    def __init__(self, req: ResponsesRequest, plan: ChatPlan, translation: ResponsesTranslation) -> None:
        self.id = new_id("resp")
        self.created_at = int(time.time())
        self._req = req
        self._plan = plan
        self.translation = translation

    def snapshot(self, status: str, output: list[dict[str, Any]], end: TurnEnd | None = None,
                 error: dict[str, Any] | None = None) -> dict[str, Any]:
        req, plan = self._req, self._plan
        reasoning = req.reasoning or {}
        incomplete = end is not None and end.stop == "length"
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "background": False, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "max_tool_calls": None,
            "model": plan.model, "output": output, "parallel_tool_calls": plan.tools.parallel,
            "previous_response_id": None, "prompt_cache_key": req.prompt_cache_key,
            "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
            "safety_identifier": req.safety_identifier, "service_tier": "default", "store": False,
            "temperature": plan.settings.sampling.temperature,
            "text": {"format": (req.text or {}).get("format") or {"type": "text"},
                     "verbosity": (req.text or {}).get("verbosity") or "medium"},
            "tool_choice": req.tool_choice or "auto", "tools": req.tools or [], "top_logprobs": 0,
            "top_p": plan.settings.sampling.top_p, "truncation": "disabled",
            "usage": _usage(end) if end is not None else None, "user": req.user, "metadata": req.metadata or {},
        }

    def final_status(self, end: TurnEnd) -> str:
        return "incomplete" if end.stop == "length" else "completed"

    def call_item(self, item_id: str, call_id: str, offered: str, arguments: str, status: str) -> dict[str, Any]:
        namespace, name = self.translation.call_name(offered)
        item = {"id": item_id, "type": "function_call", "status": status, "call_id": call_id, "name": name,
                "arguments": arguments}
        if namespace is not None:
            item["namespace"] = namespace
        return item


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if text else []}


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [_output_text(text)] if text is not None else []}


def output_items(response: _Response, turn: Turn) -> list[dict[str, Any]]:
    """The unstreamed ``output``, in order: a ``reasoning`` item (when the template reasons; its text in
    ``content``), a ``message`` item with one ``output_text`` part, and one ``function_call`` item per call
    (``call_id``, ``name``, ``arguments``, and ``namespace`` for a namespaced tool)."""
    status = "incomplete" if turn.end.stop == "length" else "completed"
    items = []
    if turn.reasoning is not None:
        items.append(_reasoning_item(new_id("rs"), turn.reasoning, status))
    if turn.content:
        items.append(_message_item(new_id("msg"), turn.content, status))
    # A forced call cut by max_output_tokens is the last call, and incomplete with the response.
    items += [response.call_item(new_id("fc"), c.id, c.name, c.arguments,
                                 status if i == len(turn.calls) - 1 else "completed")
              for i, c in enumerate(turn.calls)]
    return items


class _Stream:
    """The streamed output items: one open at a time, each opened by its first delta; events numbered.

    Each event is ``event: <type>`` and its ``data:``, numbered by ``sequence_number``. Per item:
    ``response.output_item.added``, its deltas (``response.reasoning_text.delta``,
    ``response.output_text.delta`` inside ``response.content_part.added`` / ``.done``, or
    ``response.function_call_arguments.delta`` whose pieces add up to the call's ``arguments``), their
    ``.done`` events and ``response.output_item.done``.
    """

    def __init__(self, response: _Response) -> None:
        self.response = response
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # done
        self._open: dict[str, Any] | None = None  # kind, id, text (or call_id, name)

    def event(self, kind: str, **fields: Any) -> str:
        out = sse({"type": kind, "sequence_number": self.sequence, **fields}, kind)
        self.sequence += 1
        return out

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": len(self.items)}

    def _item(self, status: str) -> dict[str, Any]:
        o = self._open
        assert o is not None
        if o["kind"] == "reasoning":
            return _reasoning_item(o["id"], o["text"], status)
        if o["kind"] == "message":
            return _message_item(o["id"], o["text"] if status != "in_progress" else None, status)
        return self.response.call_item(o["id"], o["call_id"], o["name"], o["text"], status)

    def _start(self, kind: str, **fields: Any) -> list[str]:
        out = self.close("completed")
        self._open = {"kind": kind, "id": new_id({"reasoning": "rs", "message": "msg", "call": "fc"}[kind]),
                      "text": "", **fields}
        out.append(self.event("response.output_item.added", output_index=len(self.items),
                              item=self._item("in_progress")))
        if kind == "reasoning":
            out.append(self.event("response.content_part.added", **self._where(), content_index=0,
                                  part={"type": "reasoning_text", "text": ""}))
        elif kind == "message":
            out.append(self.event("response.content_part.added", **self._where(), content_index=0,
                                  part=_output_text("")))
        return out

    def close(self, status: str) -> list[str]:
        o = self._open
        if o is None:
            return []
        where = self._where()
        if o["kind"] == "reasoning":
            out = [self.event("response.reasoning_text.done", **where, content_index=0, text=o["text"]),
                   self.event("response.content_part.done", **where, content_index=0,
                              part={"type": "reasoning_text", "text": o["text"]})]
        elif o["kind"] == "message":
            out = [self.event("response.output_text.done", **where, content_index=0, text=o["text"], logprobs=[]),
                   self.event("response.content_part.done", **where, content_index=0, part=_output_text(o["text"]))]
        else:
            out = [self.event("response.function_call_arguments.done", **where, arguments=o["text"],
                              name=self.response.translation.call_name(o["name"])[1])]
        item = self._item(status)
        out.append(self.event("response.output_item.done", output_index=len(self.items), item=item))
        self.items.append(item)
        self._open = None
        return out

    def feed(self, event: TurnEvent) -> list[str]:
        out: list[str] = []
        kind = self._open["kind"] if self._open is not None else None
        if isinstance(event, ReasoningDelta):
            if kind != "reasoning":
                out += self._start("reasoning")
            self._grow(event.text)
            out.append(self.event("response.reasoning_text.delta", **self._where(), content_index=0,
                                  delta=event.text))
        elif isinstance(event, ContentDelta):
            if kind != "message":
                out += self._start("message")
            self._grow(event.text)
            out.append(self.event("response.output_text.delta", **self._where(), content_index=0,
                                  delta=event.text, logprobs=[]))
        elif isinstance(event, CallStart):
            out += self._start("call", call_id=event.id, name=event.name)
        elif isinstance(event, ArgumentsDelta):
            self._grow(event.text)
            out.append(self.event("response.function_call_arguments.delta", **self._where(), delta=event.text))
        return out

    def _grow(self, text: str) -> None:
        assert self._open is not None
        self._open["text"] += text


class ResponsesServing:
    def __init__(self, core: ChatCore) -> None:
        self._core = core

    def _translate(self, req: InputTokensRequest) -> ResponsesTranslation:
        return to_chat(req, thinking_switch=self._core.server.thinking_switch)

    def input_tokens(self, req: InputTokensRequest) -> dict[str, Any]:
        translated = self._translate(req).translated
        plan = translated.named(lambda: self._core.plan(translated.chat))
        return {"object": "response.input_tokens", "input_tokens": len(plan.prompt)}

    async def create(self, req: ResponsesRequest) -> JSONResponse | SSEResponse:
        arrived = time.monotonic()
        translation = self._translate(req)
        translated = translation.translated
        plan = translated.named(lambda: self._core.plan(translated.chat, arrived))
        response = _Response(req, plan, translation)
        # prompt_cache_key keeps a conversation on one replica, whose prefix cache holds it.
        reply = translated.named(lambda: self._core.run_chat(plan, response.id, affinity=req.prompt_cache_key,
                                                             split_reasoning=True))
        if not plan.settings.stream:
            [turn] = await reply.whole()
            return JSONResponse(response.snapshot(response.final_status(turn.end), output_items(response, turn),
                                                  turn.end))
        await reply.start()
        return stream_response(self._stream(response, reply))

    async def _stream(self, response: _Response, reply: Reply) -> AsyncIterator[str]:
        """``response.created``, ``response.in_progress``, the items (``_Stream``), and last
        ``response.completed`` (or ``response.incomplete``) with the whole response."""
        stream = _Stream(response)
        yield stream.event("response.created", response=response.snapshot("in_progress", []))
        yield stream.event("response.in_progress", response=response.snapshot("in_progress", []))
        try:
            async for step in reply.steps():
                for event in step.events:
                    for out in stream.feed(event):
                        yield out
                if step.end is not None:
                    status = response.final_status(step.end)
                    for out in stream.close(status):
                        yield out
                    kind = "response.completed" if status == "completed" else "response.incomplete"
                    yield stream.event(kind, response=response.snapshot(status, stream.items, step.end))
        except APIError as e:
            log.warning("stream %s failed after it started: %s", response.id, e.message)
            yield stream.event("error", code=e.code, message=e.message, param=e.param)
            yield stream.event("response.failed", response=response.snapshot(
                "failed", stream.items, error={"code": e.code or "server_error", "message": e.message}))
        finally:
            await reply.aclose()
