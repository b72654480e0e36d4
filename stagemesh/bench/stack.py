"""``stagemesh bench stack``: the same load at four depths of the stack, to say what each layer costs.

One workload (``--input-len`` tokens in, ``--output-len`` out, greedy, no stop), at one stream and at
``--streams`` streams, measured at four layers: **bare**, mlx-lm's layers on the same weights with nothing else
(``stagemesh bench pipeline``'s bare batched workload: the device's limit); **engine**, the entry stage's
engine alone (``stagemesh bench engine``, in its own process); **stage gRPC**, a PP=1 ``stagemesh serve`` of
the same model loaded straight at its entry stage over ``GenerateStream``; **gateway**, the same server
through its OpenAI API. It reports tokens per second, the first token's and the inter-token time (p50) per
layer, and each layer's throughput over the one below it: the engine's cost (scheduling, continuous batching,
sampling, MLX's serving settings), then the stage's gRPC delivery of tokens, then the gateway's (HTTP,
tokenization, detokenization, SSE). Every figure comes from one invocation, so the ratios hold on any machine;
on the CPU backend the engine layer runs without the optimized BLAS (as ``stagemesh bench engine`` says), so
there its ratios mean nothing. MODEL, or ``--shape NAME``: a real-sized random-weight model (as ``stagemesh
bench compare``); by default the embedded model. Exits 1 when any request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from stagemesh.bench import flags
from stagemesh.bench.random_checkpoint import check_shape_flags, write_shape_checkpoint
from stagemesh.bench.stats import percentile
from stagemesh_core.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    flags.add_model_argument(parser)
    flags.add_shape_flags(parser)
    parser.add_argument("--streams", type=int, default=16, metavar="N",
                        help="streams at once in the second level (default %(default)s)")
    flags.add_lengths(parser, input_len=32, output_len=64)
    flags.add_rounds(parser, 2)
    flags.add_port_base(parser, 28700, "the gateway on it, the stage's gRPC on the next")
    flags.add_serve_args(parser)


def run(args: argparse.Namespace) -> int:
    if min(args.streams, args.output_len, args.input_len, args.rounds) < 1:
        raise UserError("--streams, --output-len, --input-len and --rounds must be positive")
    check_shape_flags(args)
    from stagemesh.bench.compare import server_process
    from stagemesh.bench.report import build_report, emit, flags_of, now
    from stagemesh_core.mesh_token import generate_token

    started_at = now()
    levels = sorted({1, args.streams})
    with tempfile.TemporaryDirectory(prefix="stagemesh-bench-stack-") as tmp:
        model = _model(args, Path(tmp))
        bare = _bare_layer(args, model, levels)
        engine = _engine_layer(args, model, Path(tmp))
        token = generate_token()
        env = {**os.environ, "STAGEMESH_MESH_TOKEN": token}
        env.pop("RAY_ADDRESS", None)
        grpc_port = args.port_base + 1
        command = [sys.executable, "-m", "stagemesh.cli", "serve", model, "--served-model-name", "bench-stack",
                   "--port", str(args.port_base), "--grpc-base-port", str(grpc_port),
                   "--ring-base-port", str(args.port_base + 5), "-pp", "1", *args.serve_args.split()]
        with server_process(command, "bench stack serve", f"http://127.0.0.1:{args.port_base}/health", env=env,
                            log_dir=Path(tmp) / "logs"):
            target = f"127.0.0.1:{grpc_port}"
            direct = {level: asyncio.run(_direct_level(target, token, level, args)) for level in levels}
            gateway = {level: asyncio.run(_gateway_level(f"http://127.0.0.1:{args.port_base}", level, args))
                       for level in levels}
    results = stack_results(bare, engine, direct, gateway)
    report = build_report("stack", started_at=started_at, local_mlx=True,
                          config={**flags_of(args), "model": args.shape or args.model or "default"},
                          results=results, ratios=stack_ratios(results))
    emit(report, args, "\n".join(_table(report)))
    return 1 if any(layer["failed"] for row in results["levels"] for layer in row["layers"].values()) else 0


def _model(args: argparse.Namespace, tmp: Path) -> str:
    if args.shape:
        return write_shape_checkpoint(args, tmp)
    from stage_worker.checkpoint.default_model import resolve_model_path

    return resolve_model_path(args.model)


def _bare_layer(args: argparse.Namespace, model: str, levels: list[int]) -> dict[int, dict[str, Any]]:
    """``pipeline.bare_forward`` at each level: every prompt prefilled together, then decoded in lockstep, with
    MLX's default settings (no stage's serving settings)."""
    from stagemesh.bench.pipeline import bare_forward

    layer = {}
    for level in levels:
        figures = bare_forward(model, level, args.output_len, "auto", args.input_len, args.output_len)
        layer[level] = {"tokens_per_s": round(figures["workload_tokens_per_s"], 1), "ttft_p50_ms": None,
                        "itl_p50_ms": round(level * 1e3 / figures["decode_tokens_per_s"], 3), "failed": 0}
    return layer


def _engine_layer(args: argparse.Namespace, model: str, tmp: Path) -> dict[int, dict[str, Any]]:
    """``stagemesh bench engine`` on the same checkpoint (its own process: MLX's streams, a clean heap)."""
    out = tmp / "engine.json"
    command = [sys.executable, "-m", "stagemesh.cli", "bench", "engine", model, "--output-len", str(args.output_len),
               "--streams", str(args.streams), "--input-len", str(args.input_len), "--output", str(out)]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    data = json.loads(out.read_text())["results"]
    single, many = data["single_stream"], data["streams"]
    layer = {1: {"tokens_per_s": single["tokens_per_s"], "itl_p50_ms": single["ms_per_token_p50"],
                 "ttft_p50_ms": single["first_token_ms"], "failed": 0}}
    layer[args.streams] = {"tokens_per_s": many["tokens_per_s"], "itl_p50_ms": None, "ttft_p50_ms": None,
                           "failed": 0}
    return layer


Outcome = tuple[float, list[float], str | None]  # a stream's start, its tokens' arrival times, its error


async def _direct_level(target: str, token: str, streams: int, args: argparse.Namespace) -> dict[str, Any]:
    """``streams`` requests at once over one GenerateStream call, ``args.rounds`` times after one warm-up
    round; pooled figures. Every stream of a round goes on one call as the gateway sends them, with this
    command's mesh token, from an asyncio gRPC client in this process."""
    import grpc

    from stagemesh_core.mesh_token import call_metadata
    from stagemesh_core.v1 import stage_pb2, stage_pb2_grpc

    metadata = call_metadata(token)

    def request(index: int) -> Any:
        return stage_pb2.GenerateRequest(request_id=f"stack-{streams}-{index}",
                                         prompt_token_ids=_prompt(index, args.input_len),
                                         max_tokens=args.output_len, ignore_eos=True,
                                         sampling=stage_pb2.SamplingParams(temperature=0.0))

    async def together(stub: Any, indices: range) -> list[Outcome]:
        started = time.perf_counter()
        stamps: dict[str, list[float]] = {request(i).request_id: [] for i in indices}
        errors: dict[str, str] = {}
        open_ids = set(stamps)
        call = stub.GenerateStream(metadata=metadata, timeout=600)
        await call.initial_metadata()  # the stage accepted the call (stage.proto: write after it)
        for i in indices:
            await call.write(stage_pb2.GenerateStreamRequest(start=request(i)))
        await call.done_writing()
        try:
            async for message in call:
                now = time.perf_counter()
                for update in message.updates:
                    if update.error_code:
                        errors[update.request_id] = f"{update.error_code}: {update.error_message}"
                        open_ids.discard(update.request_id)
                        continue
                    stamps[update.request_id].extend(now for _ in update.response.token_ids)
                    if update.response.finish_reason:
                        open_ids.discard(update.request_id)
        except grpc.aio.AioRpcError as exc:
            errors.update({i: f"{exc.code().name}: {exc.details()}" for i in open_ids})
        return [(started, stamps[i], errors.get(i)) for i in stamps]

    async def round_of(stub: Any, first: int) -> list[Outcome]:
        return await together(stub, range(first, first + streams))

    async with grpc.aio.insecure_channel(target) as channel:
        stub = stage_pb2_grpc.StageStub(channel)
        return await _waves(lambda first: together(stub, range(first, first + streams)), streams, args.rounds)


def _prompt(index: int, length: int) -> list[int]:
    """The ``index``-th request's prompt: distinct token ids, the same at every layer."""
    return [1000 + (index * 7919 + i * 104729) % 20000 for i in range(length)]


async def _waves(round_of: Callable[[int], Awaitable[list[Outcome]]], streams: int, rounds: int) -> dict[str, Any]:
    """One warm-up round, then ``rounds`` rounds of ``streams`` requests at once; pooled figures."""
    await round_of(0)
    tokens, wall, failed = 0, 0.0, 0
    ttfts: list[float] = []
    gaps: list[float] = []
    for round_index in range(rounds):
        started = time.perf_counter()
        results = await round_of((round_index + 1) * streams)
        wall += time.perf_counter() - started
        for begun, stamps, error in results:
            failed += error is not None
            tokens += len(stamps)
            if stamps:
                ttfts.append(stamps[0] - begun)
                gaps.extend(b - a for a, b in zip(stamps, stamps[1:]) if b > a)
    return {"tokens_per_s": round(tokens / wall, 1) if wall else None, "ttft_p50_ms": _p50_ms(ttfts),
            "itl_p50_ms": _p50_ms(gaps), "failed": failed}


async def _gateway_level(url: str, streams: int, args: argparse.Namespace) -> dict[str, Any]:
    """The stage layer's load through the OpenAI API: streaming completions of the same token-id prompts,
    each round's ``streams`` requests at once. A request's tokens are its usage's completion tokens; its
    chunks give the times (a chunk can hold several tokens, whose times are then the chunk's)."""
    import httpx

    async def one(client: httpx.AsyncClient, index: int) -> Outcome:
        body = {"model": "bench-stack", "prompt": _prompt(index, args.input_len), "max_tokens": args.output_len,
                "temperature": 0.0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        started, chunks, completion = time.perf_counter(), list[float](), 0
        try:
            async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                if response.status_code != 200:
                    return started, [], f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[len("data: "):])
                    if chunk.get("usage"):
                        completion = int(chunk["usage"]["completion_tokens"])
                    if chunk.get("choices") and chunk["choices"][0].get("text"):
                        chunks.append(time.perf_counter())
        except httpx.HTTPError as exc:
            return started, [], f"{type(exc).__name__}: {exc}"
        if not chunks:
            return started, [], "no text arrived"
        # Spread the count over the chunks' times: the last chunks' times stand for any tokens held back.
        stamps = chunks + [chunks[-1]] * max(0, completion - len(chunks))
        return started, stamps[:completion] if completion else stamps, None

    limits = httpx.Limits(max_connections=streams, max_keepalive_connections=streams)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def round_of(first: int) -> list[Outcome]:
            return list(await asyncio.gather(*(one(client, i) for i in range(first, first + streams))))

        return await _waves(round_of, streams, args.rounds)


LAYERS = ("bare", "engine", "stage_grpc", "gateway")  # bottom to top


def stack_results(bare: dict[int, dict], engine: dict[int, dict], direct: dict[int, dict],
                  gateway: dict[int, dict]) -> dict[str, Any]:
    """The four layers' figures at each level (pure)."""
    return {"levels": [{"streams": level, "layers": {"bare": bare[level], "engine": engine[level],
                                                       "stage_grpc": direct[level], "gateway": gateway[level]}}
                       for level in sorted(direct)]}


def stack_ratios(results: dict[str, Any]) -> list[dict[str, Any]]:
    """At each level, each layer's tokens/s over the layer below it and the gateway's over the bare forward
    and the engine (pure). Bare to engine is the engine (scheduling, continuous batching, sampling, MLX's
    serving settings); engine to stage gRPC the stage's delivery of tokens (on the engine's process and GIL);
    stage gRPC to gateway the gateway (HTTP, tokenization, detokenization, SSE) and its own gRPC client. On a
    GPU they show which layer caps the mesh."""
    pairs = [*zip(LAYERS[1:], LAYERS), ("gateway", "engine"), ("gateway", "bare")]
    return [{"streams": row["streams"], "compares": f"{upper} / {lower} tokens per second",
             "value": _ratio(row["layers"][upper], row["layers"][lower])}
            for row in results["levels"] for upper, lower in pairs]


def _ratio(upper: dict, lower: dict) -> float | None:
    a, b = upper.get("tokens_per_s"), lower.get("tokens_per_s")
    return round(a / b, 3) if a and b else None


def _p50_ms(values: list[float]) -> float | None:
    return _ms(percentile(values, 50))


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


def _table(report: dict[str, Any]) -> list[str]:
    lines = ["streams  layer       tok/s    TTFT p50 ms  ITL p50 ms  failed  / layer below"]
    for row in report["results"]["levels"]:
        layers = row["layers"]
        for lower, name in zip((None, *LAYERS), LAYERS):
            layer = layers[name]
            below = _ratio(layer, layers[lower]) if lower else None
            lines.append(f"{row['streams']:>7}  {name:<10}  {_cell(layer['tokens_per_s']):>7}  "
                         f"{_cell(layer['ttft_p50_ms']):>11}  {_cell(layer['itl_p50_ms']):>10}  "
                         f"{layer['failed']:>6}  {_cell(below, 'x')}")
    return lines


def _cell(value: float | None, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.2f}{suffix}" if suffix else f"{value:.1f}"
