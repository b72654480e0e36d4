"""The soak's clients: N concurrent streaming chat clients, each looping until the soak ends.

Each request is one of (weights in ``MIX``): a normal stream of a random length
(``LENGTHS`` tokens), a stream the client abandons after a few chunks (its
slot must come back on every stage), or bad input that must get a 4xx
(temperature out of range, an unknown model, a malformed body, a negative
max_tokens). Each ends as a ``RequestRecord``; a request still running at
``deadline_s``, or silent for ``stall_s``, is cancelled and recorded as hung. Only ``httpx`` and the
OpenAI wire format: what any client sees.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable

import httpx

from stagemesh.soak.report import RequestRecord

LENGTHS = (4, 16, 48, 128)
MIX = (("stream", 0.8), ("abandon", 0.12), ("bad", 0.08))
PROMPTS = ("What is the capital of France?", "Write a haiku about the sea.", "Count from one to twenty.",
           "Explain what a pipeline is in one paragraph.", "List three colours.")
BAD_INPUTS: tuple[tuple[str, bytes], ...] = (
    ("temperature 5", json.dumps({"messages": [{"role": "user", "content": "hi"}], "temperature": 5,
                                  "stream": True}).encode()),
    ("unknown model", json.dumps({"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}],
                                  "stream": True}).encode()),
    ("malformed JSON", b'{"messages": [{"role": "user", "content": '),
    ("negative max_tokens", json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1,
                                        "stream": True}).encode()),
)


def _pick(rng: random.Random) -> str:
    return rng.choices([k for k, _ in MIX], weights=[w for _, w in MIX])[0]


async def _stream(client: httpx.AsyncClient, body: bytes, leave_after: int | None) -> tuple[str, int | None, str, int]:
    """(outcome, status, error, tokens) of one streaming request."""
    chunks = 0
    async with client.stream("POST", "/v1/chat/completions", content=body,
                             headers={"content-type": "application/json"}) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            return "failed", response.status_code, text, 0
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                return "ok", 200, "", chunks
            event = json.loads(data)
            if "error" in event:  # the gateway's mid-stream failure event
                return "failed", 200, str(event["error"].get("message", event)), chunks
            if event.get("choices") and event["choices"][0].get("delta", {}).get("content"):
                chunks += 1
                if leave_after is not None and chunks >= leave_after:
                    return "abandoned", 200, "", chunks  # leaving the block closes the connection
        return "failed", 200, "the stream ended without [DONE]", chunks


async def one_request(client: httpx.AsyncClient, rng: random.Random, model: str,
                      kind: str) -> tuple[str, int | None, str, int]:
    """(outcome, status, error, tokens) of one request of ``kind``."""
    if kind == "bad":
        _, body = rng.choice(BAD_INPUTS)
        response = await client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        text = response.text
        if 400 <= response.status_code < 500 and '"error"' in text:
            return "rejected", response.status_code, "", 0
        return "failed", response.status_code, f"bad input answered {response.status_code}: {text[:200]}", 0
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
                       "max_tokens": rng.choice(LENGTHS), "temperature": rng.choice((0.0, 0.7)),
                       "stream": True}).encode()
    leave_after = rng.randint(1, 3) if kind == "abandon" else None
    return await _stream(client, body, leave_after)


async def client_loop(url: str, model: str, api_key: str | None, seed: int, clock: Callable[[], float],
                      stop_at: float, deadline_s: float, records: list[RequestRecord], verify: object = True,
                      stall_s: float = 60.0) -> None:
    rng = random.Random(seed)
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    # A hang is silence: no byte for stall_s (httpx's read timeout counts from the last byte). A slow but
    # moving stream on a loaded machine is not hung; deadline_s bounds the whole request as a backstop.
    timeout = httpx.Timeout(stall_s, connect=10.0)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout, verify=verify) as client:  # type: ignore[arg-type]
        while clock() < stop_at:
            started, kind = clock(), _pick(rng)
            try:
                outcome, status, error, tokens = await asyncio.wait_for(one_request(client, rng, model, kind),
                                                                        deadline_s)
            except TimeoutError:
                outcome, status, error, tokens = "hung", None, f"no end after {deadline_s:.0f} s", 0
            except httpx.ReadTimeout:
                outcome, status, error, tokens = "hung", None, f"no data for {stall_s:.0f} s", 0
            except (httpx.HTTPError, json.JSONDecodeError) as exc:  # the connection broke: a failure with its reason
                outcome, status, error, tokens = "failed", None, f"{type(exc).__name__}: {exc}", 0
            records.append(RequestRecord(kind, started, clock(), outcome, status, error, tokens))
            if outcome == "failed" and status in (None, 503):
                await asyncio.sleep(0.5)  # a real client backs off a little when the server says it is recovering


async def run_clients(url: str, model: str, api_key: str | None, streams: int, duration_s: float, deadline_s: float,
                      t0: float, verify: object = True, stall_s: float = 60.0) -> list[RequestRecord]:
    """Run ``streams`` clients for ``duration_s``; times in the records are seconds since ``t0``."""
    records: list[RequestRecord] = []

    def clock() -> float:
        return time.monotonic() - t0

    stop_at = clock() + duration_s
    await asyncio.gather(*(client_loop(url, model, api_key, seed, clock, stop_at, deadline_s, records, verify,
                                       stall_s) for seed in range(streams)))
    return records
