"""``stagemesh bench speculative --pp N``: speculation off against on through whole served pipelines.

Contract: starts two ``stagemesh serve -pp N`` servers of the same model on loopback (the "on" one with the
``--speculative-config`` it is given, the other without), then runs the same workload as the one-stage bench
(``speculative.PROMPTS``, greedy, each until the end-of-sequence token or ``output_len`` tokens; at each
streams level that many requests at once) through each gateway's chat completions API, the arms alternating
round by round. Per arm: output tokens (the responses' ``usage``) per second of wall time; the "on" arm's
verifications, proposed and accepted tokens (the entry stage's ``spec_decode_*`` counters from ``/mesh``,
taken before and after the arm); whether the two arms' texts are identical. The servers run with their
defaults otherwise; ``serve_args`` adds flags to both.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from stagemesh_core.errors import UserError

SERVED_MODEL = "stagemesh-bench"


@dataclass(frozen=True)
class ServedArm:
    """One server under test: its base URL and whether it speculates."""

    name: str
    url: str


def spec_counts(mesh: dict[str, Any]) -> dict[str, int]:
    """The entry stages' speculative decoding counters summed over replicas, from a ``/mesh`` document
    (pure; zeros when nothing speculated)."""
    totals = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}
    for replica in mesh.get("replicas", []):
        for stage in replica.get("stages", []):
            stats = stage.get("stats") or {}
            totals["drafts"] += int(stats.get("spec_decode_num_drafts") or 0)
            totals["draft_tokens"] += int(stats.get("spec_decode_num_draft_tokens") or 0)
            totals["accepted_tokens"] += int(stats.get("spec_decode_num_accepted_tokens") or 0)
    return totals


def counts_between(before: dict[str, int], after: dict[str, int]) -> dict[str, Any]:
    """What an arm's run added to the counters, with the acceptance figures the one-stage bench reports (pure)."""
    delta = {key: after[key] - before[key] for key in before}
    if not delta["drafts"]:
        return {}
    return {"acceptance_rate": round(delta["accepted_tokens"] / delta["draft_tokens"], 3) if delta["draft_tokens"]
            else 0.0,
            "tokens_per_verification": round((delta["accepted_tokens"] + delta["drafts"]) / delta["drafts"], 2),
            "spec_decode": delta}


def drive_served(arm: ServedArm, messages: Sequence[str], output_len: int, streams: int,
                 timeout_s: float = 600) -> dict[str, Any]:
    """The workload through ``arm``'s chat completions API, ``streams`` requests at once (at least every prompt
    once; request i asks prompt i mod their number); tokens/s over the whole run, and each request's text."""
    requests = max(len(messages), streams)
    texts: list[str] = [""] * requests
    tokens = [0] * requests
    failures: list[str] = []
    with httpx.Client(base_url=arm.url, timeout=timeout_s) as client:
        before = spec_counts(client.get("/mesh").json())

        def stream(first: int) -> None:
            for index in range(first, requests, streams):
                response = client.post("/v1/chat/completions", json={
                    "model": SERVED_MODEL, "max_tokens": output_len, "temperature": 0,
                    "messages": [{"role": "user", "content": messages[index % len(messages)]}]})
                if response.status_code != 200:
                    failures.append(f"{arm.name}: HTTP {response.status_code}: {response.text[:300]}")
                    return
                body = response.json()
                texts[index] = body["choices"][0]["message"]["content"] or ""
                tokens[index] = int(body["usage"]["completion_tokens"])

        seconds = timed_streams(streams, stream)
        after = spec_counts(client.get("/mesh").json())
    if failures:
        raise RuntimeError(f"request failed: {failures[0]}")
    total = sum(tokens)
    return {"tokens": total, "seconds": round(seconds, 3), "tokens_per_s": round(total / seconds, 1),
            "outputs": texts, **counts_between(before, after)}


def timed_streams(streams: int, stream: Callable[[int], None]) -> float:
    """Seconds for ``streams`` threads running ``stream(first)`` (first = 0..streams-1) until all return."""
    started = time.perf_counter()
    threads = [threading.Thread(target=stream, args=(first,)) for first in range(streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started


@contextlib.contextmanager
def served_arms(model: str, pp: int, config_text: str, port_base: int, serve_args: Sequence[str],
                log_dir: Path) -> Iterator[tuple[ServedArm, ServedArm]]:
    """The "off" and "on" servers of ``model`` at ``-pp pp``, both up, stopped on exit."""
    from stagemesh.bench.compare import _stagemesh_server

    if pp < 1:
        raise UserError(f"--pp {pp}: give at least 1 stage")
    common = ["-pp", str(pp), *serve_args]
    with contextlib.ExitStack() as stack:
        off = stack.enter_context(_stagemesh_server(model, port_base, common, "off", log_dir=log_dir))
        on = stack.enter_context(_stagemesh_server(model, port_base + 20,
                                                   [*common, "--speculative-config", config_text], "on",
                                                   log_dir=log_dir))
        yield ServedArm("off", off.url), ServedArm("on", on.url)


__all__ = ["ServedArm", "counts_between", "drive_served", "served_arms", "spec_counts", "timed_streams"]
