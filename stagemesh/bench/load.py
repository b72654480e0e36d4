"""The async load runner of ``stagemesh bench serve``: sends streaming requests and times every chunk.

Contract: ``send`` makes one streaming request and always returns a ``RequestRecord`` (any failure is
``ok=False`` with the HTTP status and the server's message; nothing is retried). ``closed_loop`` keeps N jobs
in flight and ``open_loop`` starts requests at seeded Poisson arrival times; both stop after ``num_prompts``
jobs or ``duration`` seconds and return records in send order. ``converse`` runs one conversation of the
multi-turn workload; ``Progress`` prints a status line per run on stderr. ``headers_for`` gives an
endpoint's ``Authorization`` header, ``endpoint_path`` its URL path.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TextIO

import httpx

from stagemesh.bench.conversation import Exchange, turn_prompt
from stagemesh.bench.types import Endpoint, Prompt, RequestRecord, RunPlan, Workload
from stagemesh.bench.workload import request_body

MAX_ERROR_CHARS = 300


def endpoint_path(endpoint_type: str) -> str:
    return "/v1/chat/completions" if endpoint_type == "chat" else "/v1/completions"


def headers_for(endpoint: Endpoint) -> dict[str, str]:
    return {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}


def _error_message(raw: bytes | str) -> str:
    """The server's error message from an OpenAI-style error body, else the body itself."""
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    try:
        doc = json.loads(text)
    except ValueError:
        return text.strip()[:MAX_ERROR_CHARS] or "(empty body)"
    err = doc.get("error", doc) if isinstance(doc, dict) else doc
    if isinstance(err, dict):
        msg = err.get("message") or err.get("detail") or json.dumps(err)
    else:
        msg = str(err)
    return str(msg)[:MAX_ERROR_CHARS]


def _chunk_text(chunk: dict[str, Any]) -> str:
    """Text of a completions or chat chunk (reasoning deltas are generated tokens too)."""
    parts = []
    for choice in chunk.get("choices") or []:
        if "text" in choice:
            parts.append(choice.get("text") or "")
        delta = choice.get("delta") or {}
        for key in ("content", "reasoning_content", "reasoning"):
            parts.append(delta.get(key) or "")
    return "".join(parts)


async def send(client: httpx.AsyncClient, endpoint: Endpoint, workload: Workload, prompt: Prompt,
               timeout: float, *, level: str, round_: int, index: int, run_start: float,
               due: float | None = None, on_chunk: Callable[[], None] | None = None, turn: int = 0,
               reply: list[str] | None = None) -> RequestRecord:
    """One streaming request, always as a ``RequestRecord``: a non-200 status, a transport error, the
    whole-request ``timeout``, an error event in the stream, a stream that ends before ``[DONE]`` /
    ``finish_reason`` or without any text all become ``ok=False`` with the HTTP status and the server's
    message. Output tokens come from the stream's ``usage`` when the server sends it, otherwise from the
    number of chunks with text; prompt tokens likewise from ``usage``, otherwise from the prompt's own
    estimate. Given a ``reply`` list, the streamed text is appended to it (a conversation's next turn re-sends
    it). ``due`` (open loop) is the ``perf_counter`` time the send was due; ``queued`` is how late it went out,
    read on the same clock reading as ``start``, so ``start - queued`` is exactly the due time."""
    assert endpoint.model is not None, "resolve the model name before sending"
    body = request_body(workload, endpoint.model, prompt)
    if endpoint.extra_body:
        body.update(json.loads(endpoint.extra_body))
    url = endpoint.base_url + endpoint_path(workload.endpoint_type)
    chunk_times: list[float] = []
    usage: dict[str, Any] | None = None
    status: int | None = None
    error: str | None = None
    finished = False
    t0 = time.perf_counter()
    queued = 0.0 if due is None else t0 - due
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", url, json=body, headers=headers_for(endpoint)) as response:
                status = response.status_code
                if status != 200:
                    error = _error_message(await response.aread())
                else:
                    async for line in response.aiter_lines():
                        now = time.perf_counter()
                        if not line.startswith("data:"):
                            continue  # blank separators, SSE comments and keep-alives
                        data = line[5:].strip()
                        if data == "[DONE]":
                            finished = True
                            break
                        try:
                            chunk = json.loads(data)
                        except ValueError:
                            error = f"unparseable stream event: {data[:100]!r}"
                            break
                        if "error" in chunk:
                            error = "error in stream: " + _error_message(json.dumps(chunk))
                            break
                        if chunk.get("usage"):
                            usage = chunk["usage"]
                        if text := _chunk_text(chunk):
                            chunk_times.append(now - t0)
                            if reply is not None:
                                reply.append(text)
                            if on_chunk is not None:
                                on_chunk()
                        if any(c.get("finish_reason") for c in chunk.get("choices") or []):
                            finished = True  # servers that omit [DONE] still end cleanly
    except TimeoutError:
        error = f"timed out after {timeout:g} s"
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    latency = time.perf_counter() - t0
    if error is None and not finished:
        error = "stream ended before [DONE] or a finish_reason"
    if error is None and not chunk_times:
        error = "the response streamed no text"
    usage_out = (usage or {}).get("completion_tokens")
    usage_in = (usage or {}).get("prompt_tokens")
    return RequestRecord(
        endpoint=endpoint.label, level=level, round=round_, index=index,
        start=t0 - run_start, latency=latency,
        ttft=chunk_times[0] if chunk_times else None, chunk_times=tuple(chunk_times),
        output_tokens=int(usage_out) if usage_out is not None else len(chunk_times),
        output_tokens_source="usage" if usage_out is not None else "chunks",
        prompt_tokens=int(usage_in) if usage_in is not None else prompt.tokens,
        prompt_tokens_source="usage" if usage_in is not None else prompt.tokens_source,
        ok=error is None, status=status, error=error, queued=queued, turn=turn,
    )


# send_indexed(index, due) -> record (due: the perf_counter time the send was due, or None); the runner fills
# in everything else.
SendFn = Callable[[int, float | None], Awaitable[RequestRecord]]
# run_indexed(index) -> the records of one job (one request, or every turn of one conversation).
JobFn = Callable[[int], Awaitable[Sequence[RequestRecord]]]
# send_turn(prompt, turn, reply) -> record, the streamed text appended to ``reply``.
TurnFn = Callable[[Prompt, int, list[str]], Awaitable[RequestRecord]]


def _more(i: int, plan: RunPlan, deadline: float | None) -> bool:
    if plan.num_prompts is not None and i >= plan.num_prompts:
        return False
    return deadline is None or time.perf_counter() < deadline


async def closed_loop(run_indexed: JobFn, concurrency: int, plan: RunPlan) -> list[RequestRecord]:
    """Keep ``concurrency`` jobs in flight: each worker starts its next job as soon as its last one ends (a job
    is one request, or one whole conversation of the multi-turn workload). No job starts after
    ``plan.num_prompts`` jobs or ``plan.duration`` seconds, whichever comes first; records in send order (by
    index, then turn)."""
    deadline = time.perf_counter() + plan.duration if plan.duration else None
    counter = itertools.count()
    records: list[RequestRecord] = []

    async def worker() -> None:
        while _more(i := next(counter), plan, deadline):
            records.extend(await run_indexed(i))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return sorted(records, key=lambda r: (r.index, r.turn))


async def converse(send_turn: TurnFn, system: Prompt, users: Sequence[Prompt]) -> list[RequestRecord]:
    """One conversation, turn after turn, each re-sending the system prompt, every earlier exchange with the
    reply received, and the next user message; a failed turn ends it (later turns would re-send a history
    the server never produced)."""
    exchanges: list[Exchange] = []
    records = []
    for turn, user in enumerate(users, 1):
        reply: list[str] = []
        record = await send_turn(turn_prompt(system, exchanges, user), turn, reply)
        records.append(record)
        if not record.ok:
            break
        exchanges.append(Exchange(user, "".join(reply), record.output_tokens))
    return records


async def open_loop(send_indexed: SendFn, rate: float, plan: RunPlan, rng: random.Random) -> list[RequestRecord]:
    """Start requests at Poisson arrival times, ``rate`` a second (drawn from ``rng``, so seeded), at most
    ``plan.max_concurrency`` running at once; stops as ``closed_loop`` does. Records in send order."""
    start = time.perf_counter()
    deadline = start + plan.duration if plan.duration else None
    cap = asyncio.Semaphore(plan.max_concurrency)

    async def one(i: int, due: float) -> RequestRecord:
        async with cap:  # the cap delays the send; latency is still measured from the send
            return await send_indexed(i, due)

    tasks = []
    due = start
    for i in itertools.count():
        if not _more(i, plan, deadline) or (deadline is not None and due >= deadline):
            break
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        tasks.append(asyncio.create_task(one(i, due)))
        due += rng.expovariate(rate) if rate != float("inf") else 0.0
    return list(await asyncio.gather(*tasks))


class Progress:
    """One status line per run on ``stream`` (requests done and failed, chunks streamed per second): rewritten
    in place on a terminal, every few seconds otherwise. ``record`` is called as each request ends."""

    def __init__(self, title: str, total: int | None, stream: TextIO = sys.stderr) -> None:
        self.title, self.total, self.stream = title, total, stream
        self.done = self.failed = self.chunks = 0
        self.start = time.perf_counter()
        self.tty = stream.isatty()

    def chunk(self) -> None:
        self.chunks += 1  # counted as they stream, so a line shows progress while long requests run

    def record(self, rec: RequestRecord) -> None:
        self.done += 1
        self.failed += 0 if rec.ok else 1

    async def tick(self) -> None:
        """Reprint the line until cancelled (requests can take long; a line per finished request would stall)."""
        while True:
            await asyncio.sleep(0.5 if self.tty else 5.0)
            self._print(final=False)

    def line(self) -> str:
        elapsed = time.perf_counter() - self.start
        total = f"/{self.total}" if self.total is not None else ""
        failed = f", {self.failed} FAILED" if self.failed else ", 0 failed"
        rate = self.chunks / elapsed if elapsed > 0 else 0.0
        return f"{self.title}: {self.done}{total} done{failed}, {rate:.1f} chunks/s streamed, {elapsed:.1f} s"

    def _print(self, final: bool) -> None:
        if self.tty:
            self.stream.write("\r\x1b[2K" + self.line() + ("\n" if final else ""))
        else:
            self.stream.write(self.line() + "\n")
        self.stream.flush()

    def finish(self) -> None:
        self._print(final=True)
