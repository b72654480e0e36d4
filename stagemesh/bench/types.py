"""The value types ``stagemesh bench serve`` passes between its modules.

Contract: frozen dataclasses only, no behaviour beyond trivial derived
properties, no imports beyond the standard library, so every bench module
(workload, load runner, statistics, report, plot) can share them without
importing one another. Times are seconds from ``time.perf_counter``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

EndpointType = Literal["completions", "chat"]
LoadKind = Literal["concurrency", "rate"]
WorkloadKind = Literal["synthetic", "multi-turn"]


@dataclass(frozen=True)
class Endpoint:
    """One server under test."""

    label: str
    base_url: str  # without a trailing "/v1"
    model: str | None  # None until resolved from GET /v1/models
    api_key: str | None = None
    extra_body: str = ""  # a JSON object merged into every request body (--extra-body)


@dataclass(frozen=True)
class Level:
    """One load level: ``concurrency`` N closed-loop workers, or Poisson arrivals at ``rate`` requests/s."""

    kind: LoadKind
    value: float

    @property
    def name(self) -> str:
        value = int(self.value) if float(self.value).is_integer() else self.value
        return f"{self.kind}={value}"


@dataclass(frozen=True)
class MultiTurn:
    """The multi-turn chat workload: ``conversations`` per level (None: as many as the level's
    concurrency), each of ``turns`` turns after a shared system prompt of ``system_tokens``; every turn
    adds a user message of ``user_tokens`` and re-sends the whole history with the replies received."""

    system_tokens: int
    user_tokens: int
    turns: int
    conversations: int | None


@dataclass(frozen=True)
class Workload:
    """What every request looks like (the same for every endpoint, so they are compared on equal terms).

    ``multi_turn`` set: the multi-turn chat workload (``input_tokens`` then sizes the warmup prompts,
    which share nothing with the conversations); None: synthetic prompts of ``input_tokens``."""

    endpoint_type: EndpointType
    input_tokens: int
    output_tokens: int
    seed: int
    ignore_eos: bool
    include_usage: bool
    temperature: float
    multi_turn: MultiTurn | None = None

    @property
    def kind(self) -> WorkloadKind:
        return "synthetic" if self.multi_turn is None else "multi-turn"


@dataclass(frozen=True)
class Prompt:
    """A prompt and how long we believe it is (the server's ``usage`` wins when it reports one).

    ``messages`` (role, content) pairs, when set, are the chat messages to send instead of one user
    message holding ``text`` (a multi-turn conversation's history); ``tokens`` then counts their contents."""

    text: str
    tokens: int
    tokens_source: Literal["tokenizer", "words"]
    messages: tuple[tuple[str, str], ...] | None = None


@dataclass(frozen=True)
class RunPlan:
    """How many requests one (endpoint, level, round) run sends and for how long."""

    num_prompts: int | None  # None: as many as fit in ``duration``
    duration: float | None  # None: until ``num_prompts`` are done
    max_concurrency: int  # cap on requests in flight for the open loop (rate levels)
    timeout: float  # whole-request limit, seconds


@dataclass(frozen=True)
class RequestRecord:
    """What happened to one request. ``start`` is relative to the start of its run; the rest to ``start``."""

    endpoint: str
    level: str
    round: int
    index: int
    start: float
    latency: float  # send to end of stream (or to the failure)
    ttft: float | None  # send to the first chunk with text
    chunk_times: tuple[float, ...]  # arrival of every chunk with text, from send
    output_tokens: int
    output_tokens_source: Literal["usage", "chunks"]
    prompt_tokens: int
    prompt_tokens_source: Literal["usage", "tokenizer", "words"]
    ok: bool
    status: int | None  # HTTP status; None when no response arrived
    error: str | None
    queued: float = 0.0  # open loop: how late the send went out after it was due (the concurrency cap, a busy client)
    turn: int = 0  # multi-turn workload: the turn (1 = first) of conversation ``index``; 0 otherwise
