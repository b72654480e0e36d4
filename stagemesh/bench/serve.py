"""``stagemesh bench serve``: load-test OpenAI-compatible endpoints, like ``vllm bench serve``.

Streams synthetic prompts (``--input-len`` tokens in, up to ``--output-len`` out) to one or more endpoints
(``--base-url``, repeatable: ours, ``mlx_lm.server``, vLLM, anything speaking the OpenAI API) at each load
level: ``--concurrency 1,4,16`` (closed loop: N requests always in flight) and/or ``--request-rate 2,8`` (open
loop: Poisson arrivals, at most ``--max-concurrency`` in flight). ``--workload multi-turn`` sends chat
conversations instead, every turn re-sending the whole history; the report then adds each turn's TTFT p50,
which shows what a prefix cache saves. Per endpoint and level it reports TTFT, inter-token latency (every gap
between streamed chunks), TPOT and end-to-end latency (mean/p50/p90/p99), output and total tokens/s,
requests/s, and completed/failed counts with every distinct error. Several endpoints take turns level by level
(every other round in reverse order), so machine noise hits all alike, and the ratios compare each to the
first. Output: a table on stdout, progress on stderr, ``--output`` (JSON), ``--plot`` (PNG). Exits 0 when every
request succeeded, 1 when any failed, 2 when the benchmark could not start. For example:
``stagemesh bench serve --base-url http://127.0.0.1:8000 --base-url http://127.0.0.1:8080 --rounds 3``.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, replace
from typing import Any
from urllib.parse import urlsplit

from stagemesh.bench import flags

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
DEFAULT_INPUT_LEN = 128
DEFAULT_SYSTEM_LEN = 128
DEFAULT_USER_LEN = 32
DEFAULT_TURNS = 3
_MULTI_TURN_FLAGS = (("--system-len", "system_len"), ("--user-len", "user_len"), ("--turns", "turns"),
                     ("--num-conversations", "num_conversations"))


class BenchSetupError(Exception):
    """The benchmark cannot start as asked; the message says what to change."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    ep = parser.add_argument_group(
        "endpoints (repeat --base-url to compare; give the others once for all or once each)")
    ep.add_argument("--base-url", action="append", default=None, metavar="URL",
                    help=f"server to load, with or without /v1 (default {DEFAULT_BASE_URL})")
    ep.add_argument("--label", action="append", default=None,
                    help="name of the endpoint in reports (default host:port)")
    ep.add_argument("--model", action="append", default=None,
                    help="model name to request (default: the first one GET /v1/models lists)")
    ep.add_argument("--extra-body", action="append", default=None, metavar="JSON",
                    help="a JSON object merged into every request body, once for all endpoints or once per "
                         "--base-url (e.g. '{\"response_format\": {\"type\": \"json_object\"}}')")
    ep.add_argument("--api-key", action="append", default=None,
                    help="sent as Authorization: Bearer KEY ('' for none; default $STAGEMESH_API_KEY, if set)")
    wl = parser.add_argument_group("workload")
    wl.add_argument("--workload", choices=("synthetic", "multi-turn"), default="synthetic",
                    help="synthetic: distinct prompts of --input-len; multi-turn: chat conversations sharing a "
                         "system prompt, every turn re-sending the history (default %(default)s)")
    wl.add_argument("--endpoint-type", choices=("completions", "chat"), default=None,
                    help="/v1/completions or /v1/chat/completions (default: completions; chat for multi-turn)")
    flags.add_lengths(wl, input_len=None, output_len=128,
                      input_note=f"synthetic workload (default {DEFAULT_INPUT_LEN})")
    wl.add_argument("--system-len", type=int, default=None,
                    help=f"multi-turn: tokens of the shared system prompt (default {DEFAULT_SYSTEM_LEN})")
    wl.add_argument("--user-len", type=int, default=None,
                    help=f"multi-turn: tokens of every user message (default {DEFAULT_USER_LEN})")
    wl.add_argument("--turns", type=int, default=None,
                    help=f"multi-turn: turns per conversation (default {DEFAULT_TURNS})")
    wl.add_argument("--num-conversations", type=int, default=None,
                    help="multi-turn: conversations per level and round (default: the level's concurrency, so "
                         "all start together)")
    flags.add_tokenizer(wl, "default: words ~ tokens")
    wl.add_argument("--ignore-eos", action="store_true",
                    help='add "ignore_eos": true to every body (vLLM, stagemesh; strict servers answer 400)')
    wl.add_argument("--no-usage", action="store_true",
                    help="do not send stream_options.include_usage (count output tokens from chunks)")
    wl.add_argument("--temperature", type=float, default=0.0, help="default %(default)s")
    flags.add_seed(wl)
    ld = parser.add_argument_group("load")
    flags.add_concurrency(ld, None, "closed loop (default 1 when no --request-rate)")
    ld.add_argument("--request-rate", default=None, metavar="R,R,...",
                    help="open-loop levels: Poisson arrivals per second ('inf': all at once)")
    ld.add_argument("--max-concurrency", type=int, default=256,
                    help="cap on requests in flight at a --request-rate level (default %(default)s)")
    flags.add_num_prompts(ld, None, "default 4 x concurrency, at least 16; for a rate, 10 s of arrivals, at least "
                                    "16; with --duration: no limit")
    ld.add_argument("--duration", type=float, default=None,
                    help="seconds per level and round after which no new request starts")
    flags.add_warmup(ld, 2, "N requests per endpoint")
    flags.add_rounds(ld, 1)
    ld.add_argument("--timeout", type=float, default=600.0,
                    help="seconds one request may take in all before it counts as failed (default %(default)s)")
    parser.add_argument("--plot", default=None, metavar="PNG", help="draw tok/s, TTFT and ITL against the load")


# ---- argument checking (pure) ----

def parse_list(text: str | None, kind: type, flag: str) -> list:
    if not text:
        return []
    try:
        values = [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise BenchSetupError(f"{flag} takes comma-separated numbers, e.g. 1,4,16; got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise BenchSetupError(f"{flag} values must be positive; got {text!r}")
    return values


def normalize_base_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise BenchSetupError(f"--base-url {url!r} must look like http://HOST:PORT (optionally ending in /v1)")
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def _per_endpoint(values: list[str] | None, n: int, flag: str, *, allow_one: bool = True) -> Sequence[str | None]:
    if not values:
        return [None] * n
    if len(values) == n:
        return list(values)
    if len(values) == 1 and allow_one:
        return values * n
    once = "once for all endpoints or " if allow_one else ""
    raise BenchSetupError(f"give {flag} {once}once per --base-url ({n}); got {len(values)}")


def _check_extra_body(extra: str | None) -> None:
    import json

    if extra is None:
        return
    try:
        value = json.loads(extra)
    except json.JSONDecodeError as e:
        raise BenchSetupError(f"--extra-body is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise BenchSetupError("--extra-body must be a JSON object")


def endpoints_from_args(args: argparse.Namespace) -> list:
    from stagemesh.bench.types import Endpoint
    from stagemesh_core import settings

    urls = [normalize_base_url(u) for u in (args.base_url or [DEFAULT_BASE_URL])]
    n = len(urls)
    labels = _per_endpoint(args.label, n, "--label", allow_one=n == 1)
    models = _per_endpoint(args.model, n, "--model")
    keys = _per_endpoint(args.api_key, n, "--api-key")
    extras = _per_endpoint(getattr(args, "extra_body", None), n, "--extra-body", allow_one=True)
    for extra in extras:
        _check_extra_body(extra)
    default_key = settings.API_KEY
    # An explicit empty --api-key means "no key" for that endpoint, not the environment's.
    eps = [Endpoint(label or urlsplit(url).netloc, url, model, default_key if key is None else key or None,
                    extra or "")
           for url, label, model, key, extra in zip(urls, labels, models, keys, extras)]
    if len({e.label for e in eps}) != n:
        raise BenchSetupError("endpoints need distinct labels; give --label once per --base-url")
    return eps


def levels_from_args(args: argparse.Namespace) -> list:
    from stagemesh.bench.types import Level

    conc = parse_list(args.concurrency, int, "--concurrency")
    rates = parse_list(args.request_rate, float, "--request-rate")
    if not conc and not rates:
        conc = [1]
    if math.inf in rates and args.duration is not None and args.num_prompts is None:
        raise BenchSetupError("--request-rate inf sends every request at once; with --duration give --num-prompts too")
    return [Level("concurrency", c) for c in conc] + [Level("rate", r) for r in rates]


def default_num_prompts(level, num_prompts: int | None, duration: float | None) -> int | None:
    if num_prompts is not None or duration is not None:
        return num_prompts
    if level.kind == "concurrency":
        return max(16, 4 * int(level.value))
    return 64 if math.isinf(level.value) else max(16, math.ceil(10 * level.value))


def check_workload_args(args: argparse.Namespace) -> None:
    """Flags of the other workload, and loads the multi-turn workload cannot run, are errors (pure)."""
    if args.workload == "synthetic":
        given = [flag for flag, name in _MULTI_TURN_FLAGS if getattr(args, name) is not None]
        if given:
            raise BenchSetupError(f"{', '.join(given)} belong(s) to the multi-turn workload; add --workload multi-turn")
        return
    for flag, value in (("--input-len", args.input_len), ("--num-prompts", args.num_prompts)):
        if value is not None:
            hint = "--system-len and --user-len size" if flag == "--input-len" else "--num-conversations counts"
            raise BenchSetupError(f"{flag} belongs to the synthetic workload; with --workload multi-turn {hint} "
                                  "the requests")
    if args.endpoint_type == "completions":
        raise BenchSetupError("--workload multi-turn sends chat messages: drop --endpoint-type completions "
                              "(or give --endpoint-type chat)")
    if args.request_rate:
        raise BenchSetupError("--workload multi-turn runs conversations closed-loop: give --concurrency N "
                              "(conversations in flight) instead of --request-rate")
    for flag, name in _MULTI_TURN_FLAGS:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise BenchSetupError(f"{flag} must be at least 1; got {value}")


def check_args(args: argparse.Namespace) -> None:
    check_workload_args(args)
    input_len = DEFAULT_INPUT_LEN if args.input_len is None else args.input_len
    for flag, value, low in (("--input-len", input_len, 1), ("--output-len", args.output_len, 1),
                             ("--max-concurrency", args.max_concurrency, 1), ("--warmup", args.warmup, 0),
                             ("--rounds", args.rounds, 1)):
        if value < low:
            raise BenchSetupError(f"{flag} must be at least {low}; got {value}")
    if args.num_prompts is not None and args.num_prompts < 1:
        raise BenchSetupError(f"--num-prompts must be at least 1; got {args.num_prompts}")
    for flag, value in (("--duration", args.duration), ("--timeout", args.timeout)):
        if value is not None and value <= 0:
            raise BenchSetupError(f"{flag} must be positive; got {value}")


# ---- running ----

async def resolve_model(client, endpoint):
    """The endpoint with its model set: as given, else the first id its GET /v1/models lists."""
    import httpx

    from stagemesh.bench.load import _error_message, headers_for

    if endpoint.model:
        return endpoint
    url = endpoint.base_url + "/v1/models"
    try:
        response = await client.get(url, headers=headers_for(endpoint), timeout=30.0)
    except httpx.HTTPError as exc:
        raise BenchSetupError(f"cannot reach {url} ({type(exc).__name__}: {exc}); is the server up? "
                              "Check --base-url.") from None
    if response.status_code != 200:
        raise BenchSetupError(f"GET {url} answered HTTP {response.status_code}: {_error_message(response.content)}; "
                              "pass --model (and --api-key if it needs one)")
    try:
        model = response.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise BenchSetupError(f"GET {url} lists no model; pass --model for {endpoint.label}") from None
    return replace(endpoint, model=model)


async def _run_one(client, endpoint, workload, level, round_: int, plan, tokenizer, title: str,
                   key_prefix: str, *, warmup: bool = False) -> list:
    """One (endpoint, level, round): its records, with progress on stderr. The warmup of the multi-turn
    workload sends synthetic prompts (it must not leave the conversations' system prompt cached)."""
    import asyncio
    import random
    import time

    from stagemesh.bench.conversation import system_prompt, user_message
    from stagemesh.bench.load import Progress, closed_loop, converse, open_loop, send
    from stagemesh.bench.workload import make_prompt

    multi_turn = None if warmup else workload.multi_turn
    jobs: dict[int, Any] = {}

    def job(i: int):
        """Request i's prompt, or conversation i's user messages (one per turn)."""
        if i not in jobs:
            if multi_turn is None:
                jobs[i] = make_prompt(f"{key_prefix}:{i}", workload.input_tokens, tokenizer)
            else:
                jobs[i] = [user_message(key_prefix, i, turn, multi_turn.user_tokens, tokenizer)
                           for turn in range(1, multi_turn.turns + 1)]
        return jobs[i]

    # One system prompt per level and round (the same for every endpoint): each run starts with none of it cached.
    system = None if multi_turn is None else system_prompt(key_prefix, multi_turn.system_tokens, tokenizer)
    for i in range(plan.num_prompts or 0):  # before the clock starts: tokenizing is not the server's time
        job(i)
    turns = 1 if multi_turn is None else multi_turn.turns
    progress = Progress(title, None if plan.num_prompts is None else plan.num_prompts * turns)
    run_start = time.perf_counter()

    async def send_indexed(i: int, due: float | None, prompt=None, turn: int = 0, reply=None):
        rec = await send(client, endpoint, workload, job(i) if prompt is None else prompt, plan.timeout,
                         level=level.name, round_=round_, index=i, run_start=run_start, due=due,
                         on_chunk=progress.chunk, turn=turn, reply=reply)
        progress.record(rec)
        return rec

    async def run_indexed(i: int) -> list:
        if system is None:
            return [await send_indexed(i, None)]
        return await converse(lambda prompt, turn, reply: send_indexed(i, None, prompt, turn, reply), system, job(i))

    ticker = asyncio.create_task(progress.tick())
    try:
        if level.kind == "concurrency":
            records = await closed_loop(run_indexed, int(level.value), plan)
        else:
            # The same arrival times for every endpoint at this level and round.
            rng = random.Random(f"{key_prefix}:arrivals")
            records = await open_loop(send_indexed, level.value, plan, rng)
    finally:
        ticker.cancel()
    progress.finish()
    return records


def level_plan(level, workload, args: argparse.Namespace):
    """How many requests (synthetic) or conversations (multi-turn) one run of ``level`` starts."""
    from stagemesh.bench.types import RunPlan

    if workload.multi_turn is not None:
        count = workload.multi_turn.conversations or int(level.value)
    else:
        count = default_num_prompts(level, args.num_prompts, args.duration)
    return RunPlan(count, args.duration, args.max_concurrency, args.timeout)


async def run_benchmark(endpoints, levels, workload, args, tokenizer) -> tuple[list, list, list]:
    """Resolve models, warm up, run every level; returns (endpoints, warmup records, measured records)."""
    import httpx

    from stagemesh.bench.types import Level, RunPlan

    # No connection cap here: the runner decides what is in flight.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    clients = {e.label: httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits) for e in endpoints}
    try:
        endpoints = [await resolve_model(clients[e.label], e) for e in endpoints]
        for e in endpoints:
            print(f"stagemesh bench serve: {e.label}: {e.base_url} model {e.model}", file=sys.stderr)
        warm_records: list = []
        if args.warmup:
            top = max((int(lv.value) for lv in levels if lv.kind == "concurrency"), default=1)
            warm_level = Level("concurrency", min(args.warmup, top))
            plan = RunPlan(args.warmup, None, args.max_concurrency, args.timeout)
            for e in endpoints:
                warm_records += await _run_one(clients[e.label], e, workload, warm_level, 0, plan, tokenizer,
                                               f"{e.label} warmup", f"{args.seed}:warmup", warmup=True)
        records: list = []
        for round_ in range(1, args.rounds + 1):
            # Reverse the order every other round so no endpoint always runs right after another.
            order = endpoints if round_ % 2 else endpoints[::-1]
            for level in levels:
                plan = level_plan(level, workload, args)
                for e in order:
                    title = f"{e.label} {level.name}" + (f" round {round_}/{args.rounds}" if args.rounds > 1 else "")
                    records += await _run_one(clients[e.label], e, workload, level, round_, plan, tokenizer, title,
                                              f"{args.seed}:{round_}:{level.name}")
        return endpoints, warm_records, records
    finally:
        for c in clients.values():
            await c.aclose()


def _group(records: list, key) -> dict:
    out: dict = {}
    for r in records:
        out.setdefault(key(r), []).append(r)
    return out


def workload_from_args(args: argparse.Namespace, tokenizer):
    """The ``Workload`` the flags ask for; a prompt too short to be distinct is a setup error."""
    from stagemesh.bench.types import EndpointType, MultiTurn, Workload
    from stagemesh.bench.workload import MIN_FILLER_TOKENS, min_input_tokens

    shortest = min_input_tokens(tokenizer)
    multi_turn = None
    if args.workload == "multi-turn":
        multi_turn = MultiTurn(
            system_tokens=DEFAULT_SYSTEM_LEN if args.system_len is None else args.system_len,
            user_tokens=DEFAULT_USER_LEN if args.user_len is None else args.user_len,
            turns=DEFAULT_TURNS if args.turns is None else args.turns,
            conversations=args.num_conversations)
        if multi_turn.system_tokens < shortest:
            raise BenchSetupError(f"--system-len {multi_turn.system_tokens} is shorter than the counting "
                                  f"instruction plus a few words; give at least {shortest}")
        if multi_turn.user_tokens < MIN_FILLER_TOKENS:
            raise BenchSetupError(f"--user-len must be at least {MIN_FILLER_TOKENS} so conversations differ "
                                  f"after the system prompt; got {multi_turn.user_tokens}")
        # The warmup's synthetic prompts are as long as a first turn.
        input_len = max(multi_turn.system_tokens + multi_turn.user_tokens, shortest)
        endpoint_type: EndpointType = "chat"
    else:
        input_len = DEFAULT_INPUT_LEN if args.input_len is None else args.input_len
        if input_len < shortest:
            raise BenchSetupError(
                f"--input-len {input_len} is shorter than the counting instruction plus a few distinct "
                f"words; give at least {shortest} (shorter prompts would all be the same "
                f"text, which a server's prompt cache answers for free)")
        endpoint_type = args.endpoint_type or "completions"
    return Workload(endpoint_type, input_len, args.output_len, args.seed, args.ignore_eos, not args.no_usage,
                    args.temperature, multi_turn)


def workload_summary(workload) -> str:
    mt = workload.multi_turn
    if mt is None:
        return f"{workload.endpoint_type}, {workload.input_tokens} tokens in, max {workload.output_tokens} out"
    conversations = mt.conversations or "concurrency"
    return (f"multi-turn chat: {conversations} conversations x {mt.turns} turns, system {mt.system_tokens} + "
            f"{mt.user_tokens} tokens per user turn, max {workload.output_tokens} out")


def run(args: argparse.Namespace) -> int:
    import asyncio

    from stagemesh.bench.report import build_report, emit, now
    from stagemesh.bench.serve_report import format_report, serve_results
    from stagemesh.bench.stats import level_metrics, ratios

    started_at = now()
    try:
        check_args(args)
        endpoints = endpoints_from_args(args)
        levels = levels_from_args(args)
        tokenizer = None
        if args.tokenizer:
            from stage_worker.checkpoint.model_spec import ModelFormatError
            from stagemesh.bench.workload import load_tokenizer
            try:
                tokenizer = load_tokenizer(args.tokenizer)
            except (ModelFormatError, OSError, ValueError) as exc:
                raise BenchSetupError(f"cannot load --tokenizer {args.tokenizer}: {exc}") from None
        workload = workload_from_args(args, tokenizer)
        endpoints, warm_records, records = asyncio.run(run_benchmark(endpoints, levels, workload, args, tokenizer))
    except BenchSetupError as exc:
        print(f"stagemesh bench serve: error: {exc}", file=sys.stderr)
        return 2

    labels = [e.label for e in endpoints]
    by_key = _group(records, lambda r: (r.endpoint, r.level))
    pooled = [level_metrics(by_key[(label, lv.name)])
              for lv in levels for label in labels if (label, lv.name) in by_key]
    by_round = _group(records, lambda r: (r.round, r.endpoint, r.level))
    per_round = [(rd, level_metrics(by_round[(rd, label, lv.name)]))
                 for rd in range(1, args.rounds + 1) for lv in levels for label in labels
                 if (rd, label, lv.name) in by_round]
    warm_by = _group(warm_records, lambda r: r.endpoint)
    warmup = [level_metrics(warm_by[label]) for label in labels if label in warm_by]
    config = {
        "endpoints": [{"label": e.label, "base_url": e.base_url, "model": e.model, "api_key": bool(e.api_key)}
                      for e in endpoints],
        "workload": {"kind": workload.kind, **asdict(workload)},
        "workload_summary": workload_summary(workload),
        "tokenizer": args.tokenizer,
        "levels": [lv.name for lv in levels],
        # Per level and round: requests (synthetic) or conversations (multi-turn).
        "num_prompts": {lv.name: level_plan(lv, workload, args).num_prompts for lv in levels},
        "duration": args.duration,
        "max_concurrency": args.max_concurrency,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "timeout": args.timeout,
        "order": "per level, endpoints in turn; every other round in reverse order",
    }
    results = serve_results(endpoints=endpoints, levels=levels, pooled=pooled, per_round=per_round, warmup=warmup,
                            records=records)
    report = build_report("serve", started_at=started_at, config=config, results=results,
                          ratios=[asdict(r) for r in ratios(pooled, [m for _, m in per_round], labels)])
    emit(report, args, format_report(report))
    if args.plot:
        from stagemesh.bench.plot import plot

        plot(report, args.plot)
        print(f"stagemesh bench serve: wrote {args.plot}", file=sys.stderr)
    failed = results["summary"]["failed"] + results["summary"]["warmup_failed"]
    if failed:
        print(f"stagemesh bench serve: {failed} request(s) FAILED; see the failures above", file=sys.stderr)
    return 1 if failed else 0
