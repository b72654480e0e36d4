"""Ollama's endpoints over the chat core: the model described, chat and generate run and answered as Ollama does.

Contract: ``OllamaServing(core, card, mesh)`` answers ``version()``, ``tags()``, ``show(body)``, ``ps()``
from the served model (``stagemesh_core.model_card``) and ``chat(body)`` / ``generate(body)`` by translating
(``gateway.ollama.translate``), having the chat core plan and run the request (``raw: true``: the core's
completion path) and encoding its turn: one JSON object, or NDJSON (``application/x-ndjson``, one object a
line, the last with ``done: true``, ``done_reason`` and the timings in nanoseconds). A body with no messages
(chat) or no prompt (generate) is Ollama's load call, answered at once with ``done_reason: "load"``. Every
check fails before anything is generated; a failure once a stream started is a ``{"error": ...}`` line.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from fastapi.responses import JSONResponse, Response

from gateway.chat.core import ChatCore
from gateway.chat.sampling import SamplingSettings, settings_from_request
from gateway.chat.translation import chat_request
from gateway.chat.turn import (
    ArgumentsDelta,
    CallStart,
    ContentDelta,
    ReasoningDelta,
    Reply,
    TokenLogprobs,
    TurnEnd,
    partial_object,
)
from gateway.http.errors import APIError, bad_request
from gateway.http.sse import STREAM_HEADERS, SSEResponse, new_id
from stagemesh_core.model_card import ModelCard, parameter_size
from stagemesh_core.settings import stagemesh_version
from stagemesh_core.snapshots import MeshView

from .protocol import ChatBody, GenerateBody, ShowBody
from .translate import (
    RawPrompt,
    ServedFacts,
    chat_to_chat,
    check_model,
    done_reason,
    generate_raw,
    generate_to_chat,
    served_name,
    within_num_ctx,
)

log = logging.getLogger("stagemesh.gateway")

# The Ollama version /api/version reports. A client may gate features on it (Ollama's tools and `think` arrived
# in 0.3 and 0.9), so it names a release whose API is the one served here; stagemesh's own version (0.x, which
# a client would read as an Ollama too old for tools) goes beside it.
OLLAMA_VERSION = "0.12.0"
# Ollama's expires_at for a model kept loaded for good (keep_alive -1): now plus Go's longest duration.
_FOREVER = timedelta(microseconds=(2**63 - 1) // 1000)
_GPU_BACKENDS = ("metal", "cuda")
Kind = Literal["chat", "generate"]


class NDJSONResponse(SSEResponse):
    """A stream of JSON lines, closed however the response ends (as every stream of the gateway)."""

    media_type = "application/x-ndjson"


def _line(obj: dict[str, Any]) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n"


def _now() -> str:
    """RFC 3339 in UTC with nanoseconds' digits, as Ollama writes ``created_at``."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f000Z")


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat().replace("+00:00", "Z")


def _ns(seconds: float) -> int:
    return max(0, round(seconds * 1e9))


def _unloads(keep_alive: str | float | None) -> bool:
    """keep_alive 0 (``0``, ``"0"``, ``"0s"``, ``"0m"``): Ollama's unload call."""
    if isinstance(keep_alive, str):
        return re.fullmatch(r"\s*0+(\.0*)?\s*[a-z]*\s*", keep_alive) is not None
    return keep_alive == 0


@dataclass
class _Clock:
    """A request's times (``time.monotonic()``): arrival, its first text, for Ollama's timing fields.

    ``prompt_eval_duration`` is arrival to the first event (queueing, the prompt's prefill and the first token,
    as the gateway sees them), ``eval_duration`` the first event to the end, ``total_duration`` arrival to the end;
    ``load_duration`` is 0: the model was loaded when ``stagemesh serve`` started."""

    arrived: float
    first: float | None = None

    def timings(self, end: TurnEnd) -> dict[str, int]:
        now = time.monotonic()
        first = self.first if self.first is not None else now
        return {"total_duration": _ns(now - self.arrived), "load_duration": 0,
                "prompt_eval_count": end.prompt_tokens, "prompt_eval_duration": _ns(first - self.arrived),
                "eval_count": end.completion_tokens, "eval_duration": _ns(now - first)}


@dataclass
class _Calls:
    """Tool calls as a stream builds them: each sent once whole (Ollama's arguments are an object)."""

    open: dict[str, Any] | None = None
    text: list[str] = field(default_factory=list)
    count: int = 0

    def _closed(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        call = {**self.open, "function": {**self.open["function"], "arguments": partial_object("".join(self.text))}}
        self.open, self.text = None, []
        return [call]

    def feed(self, event: CallStart | ArgumentsDelta) -> list[dict[str, Any]]:
        if isinstance(event, ArgumentsDelta):
            self.text.append(event.text)
            return []
        done = self._closed()
        self.open = {"id": event.id, "function": {"index": self.count, "name": event.name, "arguments": {}}}
        self.count += 1
        return done

    def finish(self) -> list[dict[str, Any]]:
        return self._closed()


class _Shape:
    """Where a reply's pieces go: chat's ``message`` (``content``, ``thinking``, ``tool_calls``) or generate's
    ``response`` and ``thinking``."""

    def __init__(self, kind: Kind, model: str) -> None:
        self.kind = kind
        self.model = model

    def object(self, content: str, thinking: str | None, calls: list[dict[str, Any]],
               logprobs: list[dict[str, Any]] | None, done: bool) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model, "created_at": _now()}
        if self.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = calls
            out["message"] = message
        else:
            out["response"] = content
            if thinking:
                out["thinking"] = thinking
        if logprobs is not None:
            out["logprobs"] = logprobs
        out["done"] = done
        return out

    def final(self, end: TurnEnd, clock: _Clock, **pieces: Any) -> dict[str, Any]:
        out = self.object(pieces.get("content", ""), pieces.get("thinking"), pieces.get("calls", []),
                          pieces.get("logprobs"), True)
        return {**out, "done_reason": done_reason(end.stop), **clock.timings(end)}

    def loaded(self, reason: str) -> dict[str, Any]:
        return {**self.object("", None, [], None, True), "done_reason": reason}


class OllamaServing:
    def __init__(self, core: ChatCore, card: ModelCard, mesh: MeshView) -> None:
        self._core = core
        self._card = card
        self._mesh = mesh

    # ------------------------------------------------------------------ the model

    @functools.cached_property
    def _reasons(self) -> bool:
        """Whether the served chat template writes reasoning, as the core's plan reads it (one tiny plan)."""
        try:
            return self._core.plan(chat_request({"messages": [{"role": "user", "content": "Hi"}]})).reading.reasons
        except APIError:
            return False

    def _facts(self) -> ServedFacts:
        server = self._core.server
        return ServedFacts(server.model, server.max_model_len, self._reasons, server.thinking_switch)

    @property
    def _name(self) -> str:
        return served_name(self._core.server.model)

    def _details(self) -> dict[str, Any]:
        card = self._card
        return {"parent_model": "", "format": card.format, "family": card.family,
                "families": [card.family] if card.family else None,
                "parameter_size": parameter_size(card.parameter_count) if card.parameter_count else "",
                "quantization_level": card.quantization_level}

    def _entry(self) -> dict[str, Any]:
        card = self._card
        return {"name": self._name, "model": self._name, "size": card.size_bytes, "digest": card.digest,
                "details": self._details()}

    def version(self) -> dict[str, str]:
        return {"version": OLLAMA_VERSION, "stagemesh_version": stagemesh_version()}

    def tags(self) -> dict[str, Any]:
        """The served model, the only one: ``GET /api/tags``."""
        return {"models": [{**self._entry(), "modified_at": _iso(self._card.modified_at)}]}

    def ps(self) -> dict[str, Any]:
        """The model while a replica serves it (none: nothing runs). ``size_vram`` is its size when the stages
        compute on a GPU (Metal, CUDA), 0 on the CPU; it never expires (``keep_alive`` does not unload it)."""
        replicas = self._mesh.snapshot().healthy_replicas
        if not replicas:
            return {"models": []}
        backends = {stage.backend for replica in replicas for stage in replica.stages}
        gpu = any(b in _GPU_BACKENDS for b in backends)
        return {"models": [{**self._entry(), "expires_at": _iso(time.time() + _FOREVER.total_seconds()),
                            "size_vram": self._card.size_bytes if gpu else 0,
                            "context_length": self._core.server.max_model_len}]}

    def show(self, body: ShowBody) -> dict[str, Any]:
        """``POST /api/show``: the details, ``model_info`` (GGUF's key names, the served context under
        ``<family>.context_length``), the capabilities, the chat template and the server's sampling defaults as
        Ollama's ``parameters`` text."""
        check_model(body.model or body.name, self._core.server.model)
        card, server = self._card, self._core.server
        family = card.family or "general"
        info: dict[str, Any] = {"general.architecture": card.family, "general.basename": server.model,
                                "general.parameter_count": card.parameter_count,
                                f"{family}.context_length": server.max_model_len}
        for key, value in (("block_count", card.num_layers), ("embedding_length", card.hidden_size),
                           ("attention.head_count", card.num_heads), ("attention.head_count_kv", card.num_kv_heads),
                           ("vocab_size", card.vocab_size)):
            if value:
                info[f"{family}.{key}"] = value
        parameters = self._parameters()
        capabilities = ["completion", "tools"] + (["thinking"] if self._reasons else [])
        return {"license": "", "modelfile": f"# served by stagemesh\nFROM {server.model}\n" + "".join(
                    f"PARAMETER {line}\n" for line in parameters),
                "parameters": "\n".join(parameters), "template": server.chat_template or "",
                "details": self._details(), "model_info": info, "capabilities": capabilities,
                "modified_at": _iso(card.modified_at)}

    def _parameters(self) -> list[str]:
        """The server's sampling defaults (``--generation-config``) in Ollama's names, one ``name value`` each."""
        defaults = self._core.server.defaults.generation
        out = [f"{ours} {value:g}" for ours, value in (
            ("temperature", defaults.temperature), ("top_p", defaults.top_p), ("top_k", defaults.top_k),
            ("min_p", defaults.min_p), ("repeat_penalty", defaults.repetition_penalty),
            ("num_predict", defaults.max_tokens)) if value is not None]
        return out + [f"num_ctx {self._core.server.max_model_len}"]

    # ------------------------------------------------------------------ generation

    def _loaded(self, shape: _Shape, stream: bool, keep_alive: str | float | None) -> Response:
        """Ollama's load (or, keep_alive 0, unload) call: the model is always loaded, and stays so."""
        obj = shape.loaded("unload" if _unloads(keep_alive) else "load")
        if stream:
            return NDJSONResponse(iter([_line(obj)]), headers=STREAM_HEADERS)
        return JSONResponse(obj)

    async def chat(self, body: ChatBody) -> Response:
        arrived = time.monotonic()
        shape = _Shape("chat", check_model(body.model, self._core.server.model))
        if not body.messages:
            return self._loaded(shape, body.stream is not False, body.keep_alive)
        request = chat_to_chat(body, self._facts())
        translated = request.translated
        plan = translated.named(lambda: self._core.plan(translated.chat, arrived))
        plan = replace(plan, settings=within_num_ctx(plan.settings, len(plan.prompt), request.num_ctx))
        request_id = new_id("ollama")
        # Ollama never refuses a budget: one past the context generates to its end (done_reason "length").
        reply = translated.named(lambda: self._core.run_chat(plan, request_id, split_reasoning=True,
                                                             fill_context=True))
        return await self._answer(reply, plan.settings, shape, _Clock(arrived))

    async def generate(self, body: GenerateBody) -> Response:
        arrived = time.monotonic()
        shape = _Shape("generate", check_model(body.model, self._core.server.model))
        if not body.prompt and not body.system:
            return self._loaded(shape, body.stream is not False, body.keep_alive)
        if body.raw:
            return await self._raw(generate_raw(body, self._facts()), shape, _Clock(arrived))
        request = generate_to_chat(body, self._facts())
        translated = request.translated
        plan = translated.named(lambda: self._core.plan(translated.chat, arrived))
        plan = replace(plan, settings=within_num_ctx(plan.settings, len(plan.prompt), request.num_ctx))
        request_id = new_id("ollama")
        reply = translated.named(lambda: self._core.run_chat(plan, request_id, split_reasoning=True,
                                                             fill_context=True))
        return await self._answer(reply, plan.settings, shape, _Clock(arrived))

    async def _raw(self, raw: RawPrompt, shape: _Shape, clock: _Clock) -> Response:
        """The prompt encoded as the completions endpoint encodes it (the tokenizer's BOS where the model wants
        one) and run on the core's completion path: no template, read back as plain text."""
        server = self._core.server
        try:
            settings = settings_from_request(raw.fields, server.defaults.generation, server.vocab_size)
        except APIError as e:
            raise raw.names.renamed(e) from None
        add_special = True if settings.add_special_tokens is None else settings.add_special_tokens
        ids = tuple(server.tokenizer.encode(raw.prompt, add_special_tokens=add_special))
        if not ids:
            raise bad_request("prompt must contain at least one token.", "prompt")
        settings = within_num_ctx(settings, len(ids), raw.num_ctx)
        reply = self._core.run_prompts([ids], settings, new_id("ollama"), clock.arrived, fill_context=True)
        return await self._answer(reply, settings, shape, clock)

    def _logprobs(self, entries: tuple[TokenLogprobs, ...] | list[TokenLogprobs]) -> list[dict[str, Any]]:
        """Ollama's logprobs: each token's text, natural-log probability and UTF-8 bytes, and its alternatives."""
        tokenizer = self._core.server.tokenizer

        def token(token_id: int, logprob: float) -> dict[str, Any]:
            text = tokenizer.decode([token_id], skip_special_tokens=False)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return [{**token(e.token_id, e.logprob), "top_logprobs": [token(i, lp) for i, lp in e.top]} for e in entries]

    async def _answer(self, reply: Reply, settings: SamplingSettings, shape: _Shape, clock: _Clock) -> Response:
        """The whole turn as one object, or the stream; both wait for the mesh's first answer first, so a mesh
        that cannot serve is still a proper HTTP status."""
        wants_logprobs = settings.sampling.logprobs is not None
        try:
            await reply.start()
        except BaseException:
            await reply.aclose()
            raise
        clock.first = time.monotonic()
        if settings.stream:
            return NDJSONResponse(self._stream(reply, shape, clock, wants_logprobs), headers=STREAM_HEADERS)
        [turn] = await reply.whole()
        calls = [{"id": c.id, "function": {"index": i, "name": c.name, "arguments": partial_object(c.arguments)}}
                 for i, c in enumerate(turn.calls)]
        return JSONResponse(shape.final(turn.end, clock, content=turn.content or "", thinking=turn.reasoning,
                                        calls=calls,
                                        logprobs=self._logprobs(turn.logprobs) if wants_logprobs else None))

    async def _stream(self, reply: Reply, shape: _Shape, clock: _Clock, wants_logprobs: bool) -> AsyncIterator[str]:
        """One object per step that brought text, reasoning or a whole call, then the ``done`` object."""
        calls = _Calls()
        try:
            async for step in reply.steps():
                thinking = "".join(e.text for e in step.events if isinstance(e, ReasoningDelta))
                content = "".join(e.text for e in step.events if isinstance(e, ContentDelta))
                whole: list[dict[str, Any]] = []
                for event in step.events:
                    if isinstance(event, CallStart | ArgumentsDelta):
                        whole += calls.feed(event)
                if step.end is not None:
                    whole += calls.finish()
                logprobs = self._logprobs(step.logprobs) if wants_logprobs and step.logprobs else None
                if content or thinking or whole or logprobs:
                    yield _line(shape.object(content, thinking, whole, logprobs, False))
                if step.end is not None:
                    yield _line(shape.final(step.end, clock))
        except APIError as e:
            log.warning("ollama stream failed after it started: %s", e.message)
            yield _line({"error": e.message})
        finally:
            await reply.aclose()
