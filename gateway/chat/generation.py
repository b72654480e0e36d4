"""A request's choices, run against the mesh, as a stream of text deltas.

Contract:
- ``ChoiceJob`` is one (prompt, choice) pair: its choice index, the prompt's token ids and the resolved token
  budget and stage sampling; ``choice_jobs(prompts, settings, max_model_len, prompt_param, fill_context)``
  makes a request's (the budget checked here: a 400 before any call; with ``fill_context`` a budget beyond
  the context is the room left, and a choice that ends there says ``context_full``).
- ``run_choices(jobs, ctx)`` starts one generation per job concurrently and yields ``ChoiceEvent``s as text
  becomes available, each job ending with exactly one event whose ``finish_reason`` is set ("stop": EOS or a
  stop string; "length": the token budget). Text is detokenized incrementally (no partial characters), stop
  strings are cut out and stop tokens never show; with logprobs requested, each event carries its tokens'.
- The first failing job raises its ``APIError`` out of the iterator and the other jobs are cancelled; closing
  the iterator (or cancelling the consumer) cancels every call. ``first_awaited(events)`` waits for the first
  event, so a stream starts only once the mesh has answered (a failure is still a proper HTTP status).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Iterable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Protocol

from gateway.http import errors
from gateway.parsing.detokenizer import IncrementalDetokenizer
from gateway.parsing.stop_strings import StopStringMatcher
from stagemesh_core.v1 import stage_pb2

from .sampling import SamplingSettings

log = logging.getLogger("stagemesh.gateway")

_FINISH = {stage_pb2.FINISH_REASON_STOP: "stop", stage_pb2.FINISH_REASON_LENGTH: "length"}


@dataclass(frozen=True)
class TokenLogprobs:
    """One generated token as the stage reported it: its id, natural-log probability and the most likely
    alternatives, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def from_proto(entries: Iterable[stage_pb2.TokenLogprob]) -> list[TokenLogprobs]:
    return [TokenLogprobs(e.token_id, e.logprob, tuple((t.token_id, t.logprob) for t in e.top)) for e in entries]


@dataclass(frozen=True)
class ChoiceJob:
    index: int
    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: stage_pb2.SamplingParams
    to_context_end: bool = False  # the budget is the room the context left, less than the request asked


def choice_jobs(prompts: Sequence[tuple[int, ...]], settings: SamplingSettings, max_model_len: int,
                prompt_param: str, fill_context: bool = False) -> list[ChoiceJob]:
    """``settings.n`` jobs per prompt, indexed prompt by prompt (OpenAI's choice order)."""
    jobs = []
    for p, ids in enumerate(prompts):
        budget = settings.max_tokens_for(len(ids), max_model_len, prompt_param, fill_context)
        bound = settings.max_tokens is not None and budget < settings.max_tokens
        jobs += [ChoiceJob(index=p * settings.n + i, prompt_ids=ids, max_tokens=budget,
                           sampling=settings.stage_sampling(i), to_context_end=bound) for i in range(settings.n)]
    return jobs


@dataclass(frozen=True)
class ChoiceEvent:
    """Text of one choice as it becomes available. ``logprobs`` (when requested) are those of the tokens
    received since the previous event: the tokens behind its text, or held back with it."""

    index: int
    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int  # so far
    logprobs: tuple[TokenLogprobs, ...] = ()
    stop_string: str | None = None  # the request's stop string that ended the choice
    context_full: bool = False  # "length" at the end of the context, not of the budget the request asked
    cached_tokens: int = 0  # prompt positions the stage restored from its prefix cache (0 until it says)


class TokenObserver(Protocol):
    def first_token(self, seconds: float, replica: int | None = None) -> None: ...
    def inter_token(self, seconds: float, count: int, replica: int | None = None) -> None: ...


class Generator(Protocol):
    def generate(self, request: stage_pb2.GenerateRequest,
                 affinity: str | None = None) -> AsyncGenerator[stage_pb2.GenerateResponse, None]: ...
    def replica_of(self, request_id: str) -> int | None: ...


@dataclass(frozen=True)
class RunContext:
    client: Generator
    tokenizer: Any
    stop_token_ids: frozenset[int]  # what the stage stops at (EOS unless ignore_eos, and the request's own)
    stop: tuple[str, ...]
    request_id: str
    observer: TokenObserver | None = None
    arrived: float | None = None  # time.monotonic() when the HTTP request arrived (TTFT starts there)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    affinity: str | None = None  # a client's cache key: the replica choice follows it (gateway.mesh.balancer)


async def run_choice(job: ChoiceJob, ctx: RunContext, started: float) -> AsyncGenerator[ChoiceEvent, None]:
    """One job's events. A stop string is cut out (kept with ``include_stop_str_in_output``) and ends the job
    (the last event names it: ``stop_string``), which cancels its gRPC call so the stage frees the slot. A stop
    token (EOS or one of the request's ``stop_token_ids``) ending the generation counts in
    ``completion_tokens`` but never shows in the text nor in the logprobs."""
    request = stage_pb2.GenerateRequest(
        request_id=f"{ctx.request_id}-{job.index}", prompt_token_ids=job.prompt_ids, max_tokens=job.max_tokens,
        sampling=job.sampling, stop_token_ids=sorted(ctx.stop_token_ids),
    )
    detok = IncrementalDetokenizer(ctx.tokenizer, job.prompt_ids, ctx.skip_special_tokens)
    stops = StopStringMatcher(ctx.stop)
    logprobs: list[TokenLogprobs] = []  # received, not yet sent with an event

    def taken() -> tuple[TokenLogprobs, ...]:
        out = tuple(logprobs)
        logprobs.clear()
        return out
    generated = 0
    cached = 0
    last_arrival: float | None = None
    prompt_tokens = len(job.prompt_ids)
    async with aclosing(ctx.client.generate(request, affinity=ctx.affinity)) as responses:
        async for response in responses:
            ids = list(response.token_ids)
            finish = response.finish_reason
            cached = max(cached, response.cached_tokens)
            if ids:
                now = time.monotonic()
                if ctx.observer is not None:
                    replica = ctx.client.replica_of(request.request_id)
                    if last_arrival is None:
                        ctx.observer.first_token(now - started, replica)
                    else:
                        ctx.observer.inter_token((now - last_arrival) / len(ids), len(ids), replica)
                last_arrival = now
                generated += len(ids)
            if finish == stage_pb2.FINISH_REASON_ABORT:
                raise errors.pipeline_failed("the stage aborted the request")
            shown = ids
            if finish == stage_pb2.FINISH_REASON_STOP and ids and ids[-1] in ctx.stop_token_ids:
                shown = ids[:-1]  # the stop token is generated (and counted) but not text
            if response.logprobs:
                logprobs.extend(from_proto(response.logprobs)[:len(shown)])
            text = detok.push(shown)
            if finish:
                text += detok.flush()
            emit, stopped = stops.feed(text)
            if stopped:
                if ctx.include_stop_str_in_output:
                    emit += stops.matched
                # Leaving the ``aclosing`` block cancels the call: the stage frees the slot now.
                yield ChoiceEvent(job.index, emit, "stop", prompt_tokens, generated, taken(), stops.matched,
                                  cached_tokens=cached)
                return
            if finish:
                reason = _FINISH.get(finish, "stop")
                yield ChoiceEvent(job.index, emit + stops.flush(), reason, prompt_tokens, generated, taken(),
                                  context_full=reason == "length" and job.to_context_end, cached_tokens=cached)
                return
            if emit:
                yield ChoiceEvent(job.index, emit, None, prompt_tokens, generated, taken(), cached_tokens=cached)
    raise errors.pipeline_failed("the stage ended the stream without a finish reason")


class _Done:
    pass


async def run_choices(jobs: Sequence[ChoiceJob], ctx: RunContext) -> AsyncGenerator[ChoiceEvent, None]:
    started = ctx.arrived if ctx.arrived is not None else time.monotonic()
    queue: asyncio.Queue[ChoiceEvent | BaseException | _Done] = asyncio.Queue()

    async def pump(job: ChoiceJob) -> None:
        try:
            async with aclosing(run_choice(job, ctx, started)) as events:
                async for event in events:
                    queue.put_nowait(event)
        except asyncio.CancelledError:
            raise
        except errors.APIError as e:
            queue.put_nowait(e)
        except Exception as e:  # noqa: BLE001 - a bug: logged here, a 500 for the client
            log.exception("choice %d of %s failed", job.index, ctx.request_id)
            queue.put_nowait(e)
        finally:
            queue.put_nowait(_Done())

    tasks = [asyncio.create_task(pump(job)) for job in jobs]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if isinstance(item, _Done):
                running -= 1
            elif isinstance(item, BaseException):
                raise item if isinstance(item, errors.APIError) else errors.internal(repr(item))
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()  # sync: safe while we are being cancelled ourselves


async def first_awaited(events: AsyncGenerator[ChoiceEvent, None]) -> AsyncGenerator[ChoiceEvent, None]:
    """``events`` again, once its first event is here (a failure before it raises, and closes ``events``)."""
    try:
        first = await anext(events)
    except BaseException:
        await events.aclose()
        raise

    async def chained() -> AsyncGenerator[ChoiceEvent, None]:
        async with aclosing(events):
            yield first
            async for event in events:
                yield event

    return chained()
