"""``stagemesh bench gateway``: the gateway alone, fed tokens as fast as a GPU mesh makes them.

Does the one gateway process (FastAPI, SSE, detokenization, gRPC client) keep up with a mesh? A GPU replica
streams tokens fast (docs/performance.md has the figures), and the gateway has one Python event loop for all
of them. This command answers it without a GPU: a **token source**, a gRPC server speaking
``stagemesh.v1.Stage`` that answers like an entry stage whose steps take ``--step-ms`` (every stream one token
per step, as in a decode batch; 0: as fast as it can), stands for the mesh in a process of its own, so its CPU
is not the gateway's; the **real gateway** (``gateway.app.create_app``, uvicorn, the model's tokenizer) runs
in front of it in another. ``stagemesh bench serve`` then loads the gateway (chat, streaming, usage) at each
``--concurrency`` level. It reports what the gateway process spent, CPU seconds per output token and its
share of one core, next to the tokens per second delivered; the ratios give the delivered rate over the
offered one (below 1: the gateway caps the mesh).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from stagemesh.bench import flags
from stagemesh_core.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    flags.add_concurrency(parser, "1,16,64")
    flags.add_num_prompts(parser, 64)
    flags.add_lengths(parser, input_len=32, output_len=64)
    parser.add_argument("--step-ms", type=float, default=5.0,
                        help="the source's decode step: every stream gets one token per step (0: no pacing) "
                             "(default %(default)s)")
    flags.add_port_base(parser, 29300, "the gateway on it, the token source on the next")
    flags.add_tokenizer(parser, "here also the gateway's, so a Hugging Face tokenizer directory (default: the "
                                "embedded model's)")
    # Internal: the two server processes this command starts.
    parser.add_argument("--serve-source", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--serve-gateway", action="store_true", help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    if args.serve_source:
        asyncio.run(_serve_source(args.port_base + 1, args.step_ms))
        return 0
    if args.serve_gateway:
        _serve_gateway(args.port_base, args.port_base + 1, args.tokenizer)
        return 0
    from stagemesh.bench.compare import server_process
    from stagemesh.bench.profile import process_cpu_seconds
    from stagemesh.bench.report import build_report, emit, flags_of, now

    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if not levels or min(levels) < 1 or args.step_ms < 0:
        raise UserError("--concurrency takes positive integers, --step-ms >= 0")
    started_at = now()
    rows = []
    with tempfile.TemporaryDirectory(prefix="stagemesh-bench-gateway-") as tmp:
        tokenizer_dir = args.tokenizer
        if tokenizer_dir is None:
            from stage_worker.checkpoint.tokenizer import default_model_tokenizer

            tokenizer_dir = str(Path(tmp) / "tokenizer")
            default_model_tokenizer().save_pretrained(tokenizer_dir)
        own = [sys.executable, "-m", "stagemesh.cli", "bench", "gateway", "--port-base", str(args.port_base),
               "--step-ms", str(args.step_ms), "--tokenizer", tokenizer_dir]
        with server_process([*own, "--serve-source"], "bench gateway source", None, startup_s=120, poll_s=0.5,
                            stop_s=20), \
                server_process([*own, "--serve-gateway"], "bench gateway gateway",
                               f"http://127.0.0.1:{args.port_base}/health", startup_s=120, poll_s=0.5,
                               stop_s=20) as gateway:
            url = f"http://127.0.0.1:{args.port_base}"

            load = functools.partial(_load, url, args, tokenizer_dir)
            load(2, 4, str(Path(tmp) / "warmup.json"))
            for level in levels:
                result = str(Path(tmp) / f"level{level}.json")
                cpu_before = process_cpu_seconds(gateway.pid)
                why = load(level, args.num_prompts, result)  # the client's start-up costs the gateway nothing
                cpu_after = process_cpu_seconds(gateway.pid)
                if not Path(result).exists() or cpu_before is None or cpu_after is None:
                    print(f"stagemesh bench gateway: level {level} produced no result:\n{why}", file=sys.stderr)
                    return 1
                stats = json.loads(Path(result).read_text())["results"]["levels"][0]
                tokens = round(float(stats["output_tokens_per_s"]) * float(stats["wall_time"]))
                rows.append(_row(level, args.step_ms, stats, tokens, cpu_after - cpu_before))
    report = build_report("gateway", started_at=started_at, config=flags_of(args), results={"levels": rows},
                          ratios=delivered_over_offered(rows))
    emit(report, args, "\n".join(_table(rows)))
    return 0 if not any(r["failed"] for r in rows) else 1


def _load(url: str, args: argparse.Namespace, tokenizer_dir: str, level: int, num_prompts: int,
          result: str) -> str:
    """Run ``stagemesh bench serve`` at one level into ``result``; returns the tail of its stderr (why, if it
    failed)."""
    done = subprocess.run([sys.executable, "-m", "stagemesh.cli", "bench", "serve", "--base-url", url,
                           "--label", "gateway",
                    "--model", "bench-gateway", "--endpoint-type", "chat", "--concurrency", str(level),
                    "--num-prompts", str(num_prompts), "--input-len", str(args.input_len),
                    "--output-len", str(args.output_len), "--ignore-eos", "--warmup", "0",
                    "--tokenizer", tokenizer_dir, "--output", result],
                   check=False, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return done.stderr[-2000:]


def _row(level: int, step_ms: float, stats: dict[str, Any], tokens: int, cpu_s: float) -> dict:
    """One level's figures (pure): the gateway's CPU over the level, per token and as a share of one core
    over the level's wall time."""
    wall = float(stats["wall_time"])
    offered = level * 1000.0 / step_ms if step_ms > 0 else None
    return {
        "concurrency": level, "offered_tokens_per_s": offered,
        "output_tokens_per_s": round(float(stats["output_tokens_per_s"]), 1),
        "ttft_p50_ms": _ms(stats["ttft"]["p50"]), "itl_p50_ms": _ms(stats["itl"]["p50"]),
        "failed": stats.get("failed", 0), "gateway_cpu_s": round(cpu_s, 2),
        "gateway_core_share": round(cpu_s / wall, 3) if wall > 0 else None,
        "gateway_cpu_ms_per_token": round(1000 * cpu_s / tokens, 3) if tokens else None,
    }


def delivered_over_offered(rows: list[dict]) -> list[dict]:
    """Each paced level's delivered tokens/s over what the source offered (below 1: the gateway caps it; pure)."""
    return [{"concurrency": r["concurrency"], "compares": "delivered / offered tokens per second",
             "value": round(r["output_tokens_per_s"] / r["offered_tokens_per_s"], 3)}
            for r in rows if r["offered_tokens_per_s"]]


def _ms(seconds: float | None) -> float | None:
    return round(1000 * seconds, 2) if seconds is not None else None


def _table(rows: list[dict]) -> list[str]:
    lines = [f"{'streams':>8} {'offered tok/s':>14} {'delivered tok/s':>16} {'ITL p50 ms':>11} "
             f"{'gateway core':>13} {'CPU ms/token':>13}"]
    for r in rows:
        offered = f"{r['offered_tokens_per_s']:.0f}" if r["offered_tokens_per_s"] else "unpaced"
        itl = f"{r['itl_p50_ms']:.2f}" if r["itl_p50_ms"] is not None else "-"
        lines.append(f"{r['concurrency']:>8} {offered:>14} {r['output_tokens_per_s']:>16.1f} "
                     f"{itl:>11} "
                     f"{100 * (r['gateway_core_share'] or 0):>12.0f}% {r['gateway_cpu_ms_per_token'] or 0:>13.3f}")
    return lines


async def _serve_source(port: int, step_ms: float) -> None:
    """A ``stagemesh.v1.Stage`` server that gives every request one token per step, over ``GenerateStream``
    one message per step for every request of the call, as the entry stage serves it. It echoes the prompt's
    own tokens, so the gateway's detokenization does real work; it is a benchmark instrument, not a model."""
    import grpc.aio

    from stagemesh_core.v1 import stage_pb2, stage_pb2_grpc

    step = _StepClock(step_ms / 1000.0)

    async def tokens(request: Any) -> AsyncIterator[Any]:
        prompt = list(request.prompt_token_ids) or [1]
        for n in range(1, request.max_tokens + 1):
            await step.next()
            yield stage_pb2.GenerateResponse(
                token_ids=[prompt[n % len(prompt)]], prompt_tokens=len(prompt), completion_tokens=n,
                finish_reason=stage_pb2.FINISH_REASON_LENGTH if n == request.max_tokens
                else stage_pb2.FINISH_REASON_UNSPECIFIED)

    class TokenSource(stage_pb2_grpc.StageServicer):
        async def GenerateStream(self, request_iterator: Any, context: Any) -> AsyncIterator[Any]:
            await context.send_initial_metadata(())  # accepted (stage.proto: clients wait for it)
            updates: asyncio.Queue[Any] = asyncio.Queue()
            running: dict[str, asyncio.Task] = {}

            async def one(request: Any) -> None:
                async for response in tokens(request):
                    updates.put_nowait(stage_pb2.GenerateUpdate(request_id=request.request_id, response=response))
                running.pop(request.request_id, None)

            async def read() -> None:
                async for message in request_iterator:
                    if message.WhichOneof("action") == "start":
                        running[message.start.request_id] = asyncio.ensure_future(one(message.start))
                    elif (task := running.pop(message.cancel, None)) is not None:
                        task.cancel()

            reader = asyncio.ensure_future(read())
            try:
                while True:
                    # Every request's token of a tick is queued before this wakes: one message a step.
                    batch = [await updates.get()]
                    while not updates.empty():
                        batch.append(updates.get_nowait())
                    yield stage_pb2.GenerateStreamResponse(updates=batch)
            finally:
                reader.cancel()
                for task in running.values():
                    task.cancel()

    server = grpc.aio.server()
    stage_pb2_grpc.add_StageServicer_to_server(TokenSource(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


class _StepClock:
    """Every waiter wakes on the next tick of a shared clock, as every row of a decode batch does."""

    def __init__(self, period_s: float) -> None:
        self._period = period_s
        self._tick: asyncio.Future | None = None

    async def next(self) -> None:
        if self._period <= 0:
            await asyncio.sleep(0)
            return
        if self._tick is None or self._tick.done():
            loop = asyncio.get_running_loop()
            tick = self._tick = loop.create_future()
            loop.call_later(self._period, _resolve, tick)
        await asyncio.shield(self._tick)


def _resolve(tick: asyncio.Future) -> None:
    if not tick.done():
        tick.set_result(None)


def _serve_gateway(port: int, source_port: int, tokenizer_dir: str) -> None:
    import uvicorn
    from transformers import AutoTokenizer

    from gateway.app import GatewayConfig, create_app
    from stagemesh_core.snapshots import MeshSnapshot, ReplicaSnapshot, StageSnapshot
    from stagemesh_core.states import StageState

    stage = StageSnapshot(rank=0, layers=(0, 1), host="127.0.0.1", grpc_port=source_port, ring_port=0, pid=None,
                          node_id="bench", compute_dtype="-", quantized=False, healthy=True,
                          state=StageState.SERVING)
    snapshot = MeshSnapshot("bench-gateway", (ReplicaSnapshot(0, (stage,)),))

    class StaticMesh:
        def snapshot(self) -> MeshSnapshot:
            return snapshot

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    app = create_app(GatewayConfig(served_model_name="bench-gateway", max_model_len=8192), mesh=StaticMesh(),
                     tokenizer=tokenizer, eos_token_ids=frozenset({tokenizer.eos_token_id}))
    uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")).run()
