"""The OpenAI completion and chat endpoints: validated request in, HTTP response out.

Contract: ``OpenAIServing.completions(req)`` / ``.chat(req)`` return a ``JSONResponse`` (non-streaming) or an
``SSEResponse`` (``stream=true``), or raise ``APIError``. Everything is validated (model, fields, prompt,
context length) before any gRPC call. A stream does not start until the first text (or the first failure) is
known, so a mesh that cannot serve still gets a proper 503 status; once a stream has started, a failure is
sent as ``data: {"error": ...}`` followed by ``data: [DONE]``.
``plan_chat(req)`` / ``run_chat(plan, request_id)`` are the chat endpoint's two halves for the other APIs the
gateway speaks (``gateway.anthropic``, ``gateway.openai_responses``): every check and the rendered prompt,
then the generation's ``ChoiceEvent``s, which they shape into their own responses.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse

from gateway.chat.generation import ChoiceEvent, ChoiceJob, Generator, RunContext, run_choices
from gateway.chat.grammar import json_schema_grammar
from gateway.chat.request import ChatCompletionRequest, CompletionRequest
from gateway.chat.sampling import SamplingSettings, settings_from_request
from gateway.chat.template import chat_options, render_chat
from gateway.chat.tool_output import ToolStream, final_message
from gateway.chat.tools import ToolPlan, tool_plan
from gateway.config import GatewayConfig
from gateway.http import errors
from gateway.http.metrics import GatewayMetrics
from gateway.parsing.tool_parsers import PARSERS, ToolFormat, pick_parser

from .logprobs import LogprobFormatter, TokenLogprobs
from .prompts import completion_prompts, echo_texts
from .responses import SSE_DONE, Kind, ResponseHeader, sse, usage

log = logging.getLogger("stagemesh.gateway")


class SSEResponse(StreamingResponse):
    """A stream whose iterator is always closed, whichever way the response ends."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with contextlib.suppress(BaseException):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]


@dataclass(frozen=True)
class ChatPlan:
    """A chat request checked and rendered: what goes to the mesh (nothing was sent yet)."""

    model: str
    settings: SamplingSettings
    prompt: tuple[int, ...]
    tools: ToolPlan
    arrived: float  # time.monotonic() when the request arrived


class OpenAIServing:
    def __init__(self, config: GatewayConfig, client: Generator, tokenizer: Any, eos_token_ids: frozenset[int],
                 metrics: GatewayMetrics) -> None:
        self._config = config
        self._client = client
        self._tokenizer = tokenizer
        # Once: ``len()`` of a Hugging Face tokenizer walks its added tokens on every call, which is slow for a
        # vocabulary with many added tokens and would run per request on the event loop (docs/performance.md
        # has the figures).
        self._vocab_size = len(tokenizer)
        self._eos = frozenset(eos_token_ids)
        self._metrics = metrics
        self._logprobs = LogprobFormatter(tokenizer)
        template = config.openai.chat_template or getattr(tokenizer, "chat_template", None)
        self.chat_template: str | None = template if isinstance(template, str) else None  # the server's
        self._tool_parser = PARSERS[pick_parser(config.openai.tool_call_parser, self.chat_template)]

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def tool_parser(self) -> ToolFormat:
        return self._tool_parser

    def check_model(self, model: str | None) -> str:
        served = self._config.served_model_name
        if model and model != served:
            raise errors.model_not_found(model, served)
        return served

    async def completions(self, req: CompletionRequest) -> JSONResponse | StreamingResponse:
        arrived = time.monotonic()
        model = self.check_model(req.model)
        settings = self._settings(req)
        add_special = True if settings.add_special_tokens is None else settings.add_special_tokens
        prompts = completion_prompts(req.prompt, self._tokenizer, self._vocab_size, add_special_tokens=add_special)
        echo = echo_texts(req.prompt, prompts, self._tokenizer) if settings.echo else None
        return await self._serve("completion", model, prompts, settings, "prompt", arrived, echo)

    async def chat(self, req: ChatCompletionRequest) -> JSONResponse | StreamingResponse:
        plan = self.plan_chat(req)
        return await self._serve("chat", plan.model, [plan.prompt], plan.settings, "messages", plan.arrived,
                                 tools=plan.tools)

    def plan_chat(self, req: ChatCompletionRequest, arrived: float | None = None) -> ChatPlan:
        """Every check of a chat request and its rendered prompt; raises ``APIError`` (nothing is sent)."""
        arrived = time.monotonic() if arrived is None else arrived
        model = self.check_model(req.model)
        settings = self._settings(req)
        tools = tool_plan(req)
        forced = tools.forced_schema()
        if forced is not None:
            if settings.sampling.grammar:
                raise errors.bad_request(f"tool_choice {tools.mode} constrains the output already; it cannot be "
                                         "combined with response_format or guided_*.", "tool_choice")
            settings = settings.with_grammar(json_schema_grammar(forced, "tools"))
        prompt = render_chat(req.messages, self._tokenizer, chat_options(req, self._config.openai), tools)
        return ChatPlan(model, settings, prompt, tools, arrived)

    def run_chat(self, plan: ChatPlan, request_id: str,
                 affinity: str | None = None) -> AsyncGenerator[ChoiceEvent, None]:
        """The plan's one choice on the mesh (the token budget is checked here, before any call); ``affinity``:
        a client's cache key, which the replica choice follows."""
        _jobs, events = self._start([plan.prompt], plan.settings, "messages", plan.arrived, request_id, affinity)
        return events

    def record_usage(self, prompt_tokens: int, completion_tokens: int) -> None:
        self._metrics.usage(prompt_tokens, completion_tokens)

    def _settings(self, req: CompletionRequest | ChatCompletionRequest) -> SamplingSettings:
        return settings_from_request(req, self._config.openai.generation, self._vocab_size)

    async def _serve(self, kind: Kind, model: str, prompts: list[tuple[int, ...]], settings: SamplingSettings,
                     prompt_param: str, arrived: float, echo: list[str] | None = None,
                     tools: ToolPlan | None = None) -> JSONResponse | StreamingResponse:
        """The request's choices, whole or streamed. Logprobs, when asked for, ride each chunk (the tokens behind
        its text) or the whole choice; a completion's ``echo`` puts the prompt's text before the completion (in
        the first chunk of a stream)."""
        tools = tools or ToolPlan()
        header = ResponseHeader.new(kind, model)
        jobs, events = self._start(prompts, settings, prompt_param, arrived, header.id)
        echoes = [echo[j.index // settings.n] for j in jobs] if echo is not None else None
        if not settings.stream:
            return await self._collect(header, jobs, settings, events, echoes, tools)
        try:
            first = await anext(events)  # a failure here is still a proper HTTP status
        except BaseException:
            await events.aclose()
            raise
        # no-cache / no buffering: proxies must pass each event on at once.
        return SSEResponse(self._stream(header, jobs, settings, first, events, echoes, tools),
                           headers={"cache-control": "no-cache", "x-accel-buffering": "no"})

    def _start(self, prompts: list[tuple[int, ...]], settings: SamplingSettings, prompt_param: str, arrived: float,
               request_id: str,
               affinity: str | None = None) -> tuple[list[ChoiceJob], AsyncGenerator[ChoiceEvent, None]]:
        max_len = self._config.max_model_len
        jobs = [
            ChoiceJob(index=p * settings.n + i, prompt_ids=ids,
                      max_tokens=settings.max_tokens_for(len(ids), max_len, prompt_param),
                      sampling=settings.stage_sampling(i))
            for p, ids in enumerate(prompts) for i in range(settings.n)
        ]
        ctx = RunContext(client=self._client, tokenizer=self._tokenizer,
                         stop_token_ids=settings.stop_token_ids(self._eos), stop=settings.stop,
                         request_id=request_id, observer=self._metrics, arrived=arrived,
                         skip_special_tokens=settings.skip_special_tokens,
                         include_stop_str_in_output=settings.include_stop_str_in_output, affinity=affinity)
        return jobs, run_choices(jobs, ctx)

    def _format_logprobs(self, kind: Kind, entries: list[TokenLogprobs], offset: int) -> tuple[dict[str, Any], int]:
        if kind == "chat":
            return {"content": self._logprobs.chat(entries), "refusal": None}, offset
        return self._logprobs.completion(entries, offset)

    async def _collect(self, header: ResponseHeader, jobs: list[ChoiceJob], settings: SamplingSettings,
                       events: AsyncGenerator[ChoiceEvent, None], echoes: list[str] | None,
                       tools: ToolPlan) -> JSONResponse:
        texts: list[list[str]] = [[e] for e in echoes] if echoes is not None else [[] for _ in jobs]
        finish: list[str | None] = [None] * len(jobs)
        completion = [0] * len(jobs)
        entries: list[list[TokenLogprobs]] = [[] for _ in jobs]
        async with contextlib.aclosing(events):
            async for ev in events:
                texts[ev.index].append(ev.text)
                entries[ev.index].extend(ev.logprobs)
                completion[ev.index] = ev.completion_tokens
                if ev.finish_reason:
                    finish[ev.index] = ev.finish_reason
        use = usage(_prompt_tokens(jobs, settings.n), sum(completion))
        self._metrics.usage(sum(len(j.prompt_ids) for j in jobs), use["completion_tokens"])
        logprobs: list[dict[str, Any] | None] | None = None
        if settings.sampling.logprobs is not None:
            logprobs = [self._format_logprobs(header.kind, e, 0)[0] for e in entries]
        contents: list[str | None] = ["".join(t) for t in texts]
        calls: list[list[dict[str, Any]]] | None = None
        if tools.active:
            calls = []
            for i, text in enumerate(list(contents)):
                contents[i], found, finish[i] = final_message(text or "", finish[i], tools, self._tool_parser)
                calls.append([c.to_json() for c in found])
        return JSONResponse(header.full(contents, finish, use, logprobs, calls))

    async def _stream(self, header: ResponseHeader, jobs: list[ChoiceJob], settings: SamplingSettings,
                      first: ChoiceEvent, events: AsyncGenerator[ChoiceEvent, None],
                      echoes: list[str] | None, tools: ToolPlan) -> AsyncIterator[str]:
        inc = settings.include_usage
        completion = [0] * len(jobs)
        offsets = [0] * len(jobs)  # completions' text_offset, per choice
        streams = [ToolStream(tools, self._tool_parser) for _ in jobs] if tools.active else None
        unsent: list[list[TokenLogprobs]] = [[] for _ in jobs]  # logprobs of tool-stream text not sent yet
        try:
            if header.kind == "chat":
                for job in jobs:  # OpenAI opens each choice with the assistant role
                    yield sse(header.chunk(job.index, None, None, role=True, include_usage=inc))
            for job, text in zip(jobs, echoes or (), strict=False):
                yield sse(header.chunk(job.index, text, None, include_usage=inc))
            pending: ChoiceEvent | None = first
            while True:
                ev = pending if pending is not None else await anext(events, None)
                pending = None
                if ev is None:
                    break
                completion[ev.index] = ev.completion_tokens
                if streams is not None:
                    for chunk in self._tool_chunks(header, streams[ev.index], ev, inc, unsent[ev.index]):
                        yield sse(chunk)
                    continue
                if ev.text or ev.finish_reason:
                    logprobs = None
                    if settings.sampling.logprobs is not None:
                        logprobs, offsets[ev.index] = self._format_logprobs(header.kind, list(ev.logprobs),
                                                                            offsets[ev.index])
                    yield sse(header.chunk(ev.index, ev.text, ev.finish_reason, include_usage=inc,
                                           logprobs=logprobs))
            use = usage(_prompt_tokens(jobs, settings.n), sum(completion))
            self._metrics.usage(sum(len(j.prompt_ids) for j in jobs), use["completion_tokens"])
            if inc:
                yield sse(header.usage_chunk(use))
        except errors.APIError as e:
            log.warning("stream %s failed after it started: %s", header.id, e.message)
            yield sse(e.body())
        finally:
            with contextlib.suppress(BaseException):
                await events.aclose()
        yield SSE_DONE


    def _tool_chunks(self, header: ResponseHeader, stream: ToolStream, ev: ChoiceEvent, inc: bool,
                     unsent: list[TokenLogprobs]) -> list[dict[str, Any]]:
        """A chat event as content or tool-call deltas. Logprobs ride the first chunk sent; those of text the
        stream holds (a partial marker, a call's JSON around its arguments) wait in ``unsent`` for the next one."""
        deltas = stream.feed(ev.text)
        finish = None
        if ev.finish_reason:
            last, finish = stream.finish(ev.finish_reason)
            deltas += last
        unsent.extend(ev.logprobs)
        chunks = []
        for delta in deltas:
            chunks.append(header.chunk(ev.index, None, None, include_usage=inc, delta=delta,
                                       logprobs=self._chat_logprobs(unsent)))
        if finish:
            chunks.append(header.chunk(ev.index, None, finish, include_usage=inc,
                                       logprobs=self._chat_logprobs(unsent)))
        return chunks

    def _chat_logprobs(self, entries: list[TokenLogprobs]) -> dict[str, Any] | None:
        """The entries as a chunk's chat logprobs (None when there are none), emptying the list."""
        if not entries:
            return None
        out = {"content": self._logprobs.chat(list(entries)), "refusal": None}
        entries.clear()
        return out


def _prompt_tokens(jobs: list[ChoiceJob], n: int) -> int:
    """Each prompt counts once however many choices it has (OpenAI's usage)."""
    return sum(len(j.prompt_ids) for j in jobs if j.index % n == 0)
