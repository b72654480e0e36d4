"""The OpenAI completion and chat endpoints: a validated request in, the core's reply encoded as OpenAI's.

Contract: ``OpenAIServing(core).completions(req)`` / ``.chat(req)`` return a ``JSONResponse`` (non-streaming)
or an ``SSEResponse`` (``stream=true``), or raise ``APIError``. Everything is validated by the core (model,
fields, prompt, context length) before any gRPC call; a chat request is planned and run by the core
(``gateway.chat.core``) and its reply read back once there (``gateway.chat.turn``), its text left as the model
wrote it (no reasoning split). A stream does not start until the first text (or the first failure) is known,
so a mesh that cannot serve still gets a proper 503 status; once a stream has started, a failure is sent as
``data: {"error": ...}`` followed by ``data: [DONE]``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse

from gateway.chat.core import ChatCore
from gateway.chat.sampling import SamplingSettings, settings_from_request
from gateway.chat.tool_output import openai_delta
from gateway.chat.turn import Reply, TokenLogprobs, Turn, TurnStep
from gateway.http import errors
from gateway.http.sse import SSEResponse, sse, stream_response

from .logprobs import LogprobFormatter
from .prompts import completion_prompts, echo_texts
from .responses import SSE_DONE, Kind, ResponseHeader, usage
from .schemas import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("stagemesh.gateway")


class OpenAIServing:
    def __init__(self, core: ChatCore) -> None:
        self._core = core
        self._logprobs = LogprobFormatter(core.server.tokenizer)

    async def completions(self, req: CompletionRequest) -> JSONResponse | SSEResponse:
        arrived = time.monotonic()
        server = self._core.server
        model = server.check_model(req.model)
        settings = settings_from_request(req, server.defaults.generation, server.vocab_size,
                                         server.defaults.structured_output_strict)
        add_special = True if settings.add_special_tokens is None else settings.add_special_tokens
        prompts = completion_prompts(req.prompt, server.tokenizer, server.vocab_size, add_special_tokens=add_special)
        echo = echo_texts(req.prompt, prompts, server.tokenizer) if settings.echo else None
        header = ResponseHeader.new("completion", model)
        reply = self._core.run_prompts(prompts, settings, header.id, arrived)
        echoes = [echo[j.index // settings.n] for j in reply.jobs] if echo is not None else None
        return await self._serve(header, reply, settings, echoes, tools=False)

    async def chat(self, req: ChatCompletionRequest) -> JSONResponse | SSEResponse:
        plan = self._core.plan(req)
        header = ResponseHeader.new("chat", plan.model)
        reply = self._core.run_chat(plan, header.id)
        return await self._serve(header, reply, plan.settings, None, tools=plan.tools.active)

    async def _serve(self, header: ResponseHeader, reply: Reply, settings: SamplingSettings,
                     echoes: list[str] | None, tools: bool) -> JSONResponse | SSEResponse:
        """The request's choices, whole or streamed. Logprobs, when asked for, ride each chunk (the tokens behind
        its text) or the whole choice; a completion's ``echo`` puts the prompt's text before the completion (in
        the first chunk of a stream)."""
        if not settings.stream:
            return self._whole(header, reply, settings, await reply.whole(), echoes, tools)
        await reply.start()  # a failure here is still a proper HTTP status
        return stream_response(self._stream(header, reply, settings, echoes, tools))

    def _format_logprobs(self, kind: Kind, entries: list[TokenLogprobs], offset: int) -> tuple[dict[str, Any], int]:
        if kind == "chat":
            return {"content": self._logprobs.chat(entries), "refusal": None}, offset
        return self._logprobs.completion(entries, offset)

    def _whole(self, header: ResponseHeader, reply: Reply, settings: SamplingSettings, turns: list[Turn],
               echoes: list[str] | None, tools: bool) -> JSONResponse:
        use = usage(_prompt_tokens(reply, settings.n), sum(t.end.completion_tokens for t in turns),
                    _cached_tokens({t.index: t.end.cached_tokens for t in turns}, settings.n))
        logprobs: list[dict[str, Any] | None] | None = None
        if settings.sampling.logprobs is not None:
            logprobs = [self._format_logprobs(header.kind, list(t.logprobs), 0)[0] for t in turns]
        contents: list[str | None] = [t.content for t in turns]
        if echoes is not None:
            contents = [e + (c or "") for e, c in zip(echoes, contents, strict=True)]
        calls = [[c.to_json() for c in t.calls] for t in turns] if tools else None
        finish: list[str | None] = [t.end.finish_reason for t in turns]
        return JSONResponse(header.full(contents, finish, use, logprobs, calls))

    async def _stream(self, header: ResponseHeader, reply: Reply, settings: SamplingSettings,
                      echoes: list[str] | None, tools: bool) -> AsyncIterator[str]:
        inc = settings.include_usage
        completion = [0] * len(reply.jobs)
        cached: dict[int, int] = {}  # by choice, once it ended
        offsets = [0] * len(reply.jobs)  # completions' text_offset, per choice
        unsent: list[list[TokenLogprobs]] = [[] for _ in reply.jobs]  # logprobs of tool-stream text not sent yet
        try:
            if header.kind == "chat":
                for job in reply.jobs:  # OpenAI opens each choice with the assistant role
                    yield sse(header.chunk(job.index, None, None, role=True, include_usage=inc))
            for job, text in zip(reply.jobs, echoes or (), strict=False):
                yield sse(header.chunk(job.index, text, None, include_usage=inc))
            async for step in reply.steps():
                completion[step.index] = step.completion_tokens
                if step.end is not None:
                    cached[step.index] = step.end.cached_tokens
                if tools:
                    for chunk in self._tool_chunks(header, step, inc, unsent[step.index]):
                        yield sse(chunk)
                    continue
                finish = step.end.finish_reason if step.end is not None else None
                if step.text or finish:
                    logprobs = None
                    if settings.sampling.logprobs is not None:
                        logprobs, offsets[step.index] = self._format_logprobs(header.kind, list(step.logprobs),
                                                                              offsets[step.index])
                    yield sse(header.chunk(step.index, step.text, finish, include_usage=inc, logprobs=logprobs))
            if inc:
                yield sse(header.usage_chunk(usage(_prompt_tokens(reply, settings.n), sum(completion),
                                                   _cached_tokens(cached, settings.n))))
        except errors.APIError as e:
            log.warning("stream %s failed after it started: %s", header.id, e.message)
            yield sse(e.body())
        finally:
            await reply.aclose()
        yield SSE_DONE

    def _tool_chunks(self, header: ResponseHeader, step: TurnStep, inc: bool,
                     unsent: list[TokenLogprobs]) -> list[dict[str, Any]]:
        """A chat step as content or tool-call deltas. Logprobs ride the first chunk sent; those of text the
        stream holds (a partial marker, a call's JSON around its arguments) wait in ``unsent`` for the next one."""
        unsent.extend(step.logprobs)
        chunks = [header.chunk(step.index, None, None, include_usage=inc, delta=openai_delta(event),
                               logprobs=self._chat_logprobs(unsent)) for event in step.events]
        if step.end is not None:
            chunks.append(header.chunk(step.index, None, step.end.finish_reason, include_usage=inc,
                                       logprobs=self._chat_logprobs(unsent)))
        return chunks

    def _chat_logprobs(self, entries: list[TokenLogprobs]) -> dict[str, Any] | None:
        """The entries as a chunk's chat logprobs (None when there are none), emptying the list."""
        if not entries:
            return None
        out = {"content": self._logprobs.chat(list(entries)), "refusal": None}
        entries.clear()
        return out


def _prompt_tokens(reply: Reply, n: int) -> int:
    """Each prompt counts once however many choices it has (OpenAI's usage)."""
    return sum(len(j.prompt_ids) for j in reply.jobs if j.index % n == 0)


def _cached_tokens(by_choice: dict[int, int], n: int) -> int:
    """The cached positions of each prompt's first choice: a prompt counts once (``_prompt_tokens``)."""
    return sum(count for index, count in by_choice.items() if index % n == 0)
