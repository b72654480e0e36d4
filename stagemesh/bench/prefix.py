"""``stagemesh bench prefix``: what the prefix cache is worth, the entry stage alone, cache off against on.

Loads MODEL (default: the embedded model) as one stage (as ``stagemesh bench engine`` does: no gRPC, no
gateway), with what a stage would choose on this machine (the optimized BLAS preloaded, dense weights where
``choose_dense_weights`` says so), and runs two workloads twice in one invocation, with
``--no-enable-prefix-caching`` and with the cache on:

* **multi-turn chat**: ``--conversations`` conversations at once, each of ``--turns`` turns; every turn's
  prompt is a shared system prompt of ``--system-len`` tokens, the conversation's whole history (earlier user
  turns and the replies generated for them) and a new user turn of ``--user-len`` tokens;
* **distinct prompts**: as many requests at once, prompts sharing nothing (what the cache costs when it
  never hits).

It reports time to first token (p50, over all turns and over turns after the first of each conversation),
tokens per second, the hit rate, and the on/off ratios. Greedy decoding; the token ids are random but fixed.
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from typing import Any

from stagemesh.bench import flags
from stagemesh_core import defaults
from stagemesh_core.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    flags.add_model_argument(parser)
    parser.add_argument("--conversations", type=int, default=8, help="conversations at once (default %(default)s)")
    parser.add_argument("--turns", type=int, default=4, help="turns per conversation (default %(default)s)")
    parser.add_argument("--system-len", type=int, default=256,
                        help="tokens of the shared system prompt (default %(default)s)")
    parser.add_argument("--user-len", type=int, default=32, help="tokens of each user turn (default %(default)s)")
    flags.add_lengths(parser, input_len=None, output_len=32, with_input=False, output_note="here, per turn")
    parser.add_argument("--block-size", type=int, default=defaults.PREFIX_CACHE_BLOCK_SIZE,
                        help="prefix-cache block size (default %(default)s)")


RATIO_KEYS = ("ttft_p50_s", "ttft_p50_later_turns_s", "tokens_per_s")


def run(args: argparse.Namespace) -> int:
    if min(args.conversations, args.turns, args.system_len, args.user_len, args.output_len, args.block_size) < 1:
        raise UserError("--conversations, --turns, --system-len, --user-len, --output-len and --block-size "
                        "must be positive")
    from stage_worker.model.blas import reexec_with_optimized_blas

    # As a stage does (stage_worker.service.process_setup): MLX's CPU kernels with the optimized BLAS, if any.
    reexec_with_optimized_blas(["-m", "stagemesh.cli", *sys.argv[1:]], None)
    from stage_worker.checkpoint.default_model import resolve_model_path
    from stage_worker.checkpoint.model_reader import read_model_spec
    from stage_worker.model.blas import loaded_blas
    from stagemesh.bench.report import build_report, emit, flags_of, now

    started_at = now()
    spec = read_model_spec(resolve_model_path(args.model))
    model, dense = load_stage_as_served(spec)
    _drive(model, args, cache=False, workload="distinct", conversations=1)  # warm the kernels
    results: dict[str, Any] = {}
    ratios = []
    for workload in ("multi_turn", "distinct"):
        off = _drive(model, args, cache=False, workload=workload, conversations=args.conversations)
        on = _drive(model, args, cache=True, workload=workload, conversations=args.conversations)
        results[workload] = {"cache_off": off, "cache_on": on}
        ratios.append({"workload": workload, "compares": "cache on / cache off",
                       **{key: round(on[key] / off[key], 3) for key in RATIO_KEYS if on.get(key) and off.get(key)}})
    report = build_report("prefix", started_at=started_at, local_mlx=True, results=results, ratios=ratios,
                          config={**flags_of(args), "model": spec.default_served_name, "blas": loaded_blas(),
                                  "dense_weights": dense})
    emit(report, args, format_prefix(report))
    return 0


def load_stage_as_served(spec: Any) -> tuple[Any, bool]:
    """The whole model as one stage, with what a stage would choose on this machine (dense weights where
    ``choose_dense_weights`` says so, joined projections where ``fusion_wanted`` does); and whether dense."""
    import psutil

    from stage_worker.model.blas import loaded_blas
    from stage_worker.model.device import current_backend
    from stage_worker.model.fused_projections import fusion_wanted
    from stage_worker.model.stage_model import StageModel, StageRole, choose_dense_weights, resolve_compute_dtype
    from stagemesh_core import settings
    from stagemesh_core.layer_split import LayerRange

    backend = current_backend()
    model = StageModel.load(spec, StageRole(LayerRange(0, spec.num_layers), True, True),
                            resolve_compute_dtype("auto", backend))
    dense, _ = choose_dense_weights("auto", backend=backend, blas=loaded_blas(), quantized=model.quantized,
                                    dense_bytes=model.dense_bytes(),
                                    memory_budget=int(psutil.virtual_memory().total * 0.8))
    if dense:
        model.dequantize()
    if fusion_wanted(settings.FUSE_PROJECTIONS, backend):  # as a stage does
        model.fuse_projections()
    return model, dense


def format_prefix(report: dict[str, Any]) -> str:
    """Each workload with the cache off and on, and on over off (pure)."""
    lines = [f"{'workload':<11} {'cache':<6} {'TTFT p50 s':>11} {'later turns s':>14} {'tok/s':>9} {'hit rate':>9}"]
    for workload, arms in report["results"].items():
        for arm, figures in arms.items():
            lines.append(f"{workload:<11} {arm.removeprefix('cache_'):<6} {_cell(figures['ttft_p50_s']):>11} "
                         f"{_cell(figures['ttft_p50_later_turns_s']):>14} {_cell(figures['tokens_per_s']):>9} "
                         f"{_cell(figures.get('prefix_cache_hit_rate')):>9}")
    for ratio in report["ratios"]:
        values = ", ".join(f"{key} {ratio[key]:.3f}x" for key in RATIO_KEYS if key in ratio)
        lines.append(f"{ratio['workload']}, {ratio['compares']}: {values}")
    return "\n".join(lines)


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def _drive(model: Any, args: argparse.Namespace, *, cache: bool, workload: str, conversations: int) -> dict:
    from stage_worker.cache.prefix_cache import PrefixCache
    from stage_worker.engine.entry_engine import EntryEngine, RequestFailed
    from stage_worker.engine.scheduler import GenerationRequest, Scheduler
    from stage_worker.engine.stage_runtime import EntryPipeline, StageCompute
    from stage_worker.engine.stage_status import StageStatus
    from stagemesh.bench.engine import drive_engine, run_threads

    turns = args.turns if workload == "multi_turn" else 1
    longest = args.system_len + turns * (args.user_len + args.output_len) + 1
    prefix_cache = PrefixCache(args.block_size) if cache else None
    scheduler = Scheduler(max_num_seqs=max(16, conversations), max_model_len=longest,
                          max_waiting=max(64, conversations), prefix_cache=prefix_cache)
    engine = EntryEngine(EntryPipeline(StageCompute(model, max(16, conversations)), None, None, is_last=True),
                         scheduler, StageStatus())
    rng = random.Random(7)  # the same token ids with the cache off and on
    system = tuple(rng.randrange(300, 20000) for _ in range(args.system_len))
    ttfts: list[tuple[int, float]] = []  # (turn, seconds)
    generated = [0]
    lock = threading.Lock()

    def conversation(index: int) -> None:
        local = random.Random(1000 + index)
        history: tuple[int, ...] = system if workload == "multi_turn" else \
            tuple(local.randrange(300, 20000) for _ in range(args.system_len))
        for turn in range(turns):
            history += tuple(local.randrange(300, 20000) for _ in range(args.user_len))
            started = time.perf_counter()
            handle = engine.submit(GenerationRequest(f"c{index}t{turn}", history, args.output_len,
                                                     ignore_eos=True))
            reply: list[int] = []
            while True:
                event = handle.events.get(timeout=600)
                if isinstance(event, RequestFailed):
                    raise RuntimeError(f"request failed: {event.message}")
                if not reply and event.token_ids:
                    with lock:
                        ttfts.append((turn, time.perf_counter() - started))
                reply += event.token_ids
                if event.finish is not None:
                    break
            with lock:
                generated[0] += len(reply)
            history += tuple(reply)

    outcome: dict[str, float] = {}

    indexes = iter(range(conversations))  # each client thread takes the next conversation

    def clients() -> None:
        outcome["seconds"] = run_threads(lambda: conversation(next(indexes)), conversations)

    drive_engine(engine, clients)
    if "seconds" not in outcome:
        raise RuntimeError("the engine stopped before every conversation finished")
    later = [s for turn, s in ttfts if turn > 0]
    result = {"ttft_p50_s": round(_p50([s for _, s in ttfts]), 4),
              "ttft_p50_later_turns_s": round(_p50(later), 4) if later else None,
              "tokens_per_s": round(generated[0] / outcome["seconds"], 1)}
    if prefix_cache is not None:
        stats = prefix_cache.stats
        result["prefix_cache_hit_rate"] = round(stats.hits / stats.queries, 3) if stats.queries else 0.0
    return result


def _p50(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]
