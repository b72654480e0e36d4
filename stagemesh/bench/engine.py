"""``stagemesh bench engine``: the entry stage alone (engine, scheduler, model), no gRPC and no gateway.

Loads a whole model as one stage (MODEL, the embedded default model, or ``--shape``: a real-sized random-weight
checkpoint from ``random_checkpoint``) and drives its ``EntryEngine`` directly from a client thread, as the
stage's gRPC handlers would: one stream of ``--output-len`` tokens (time per token, p50), then ``--streams``
streams together (tokens/s); ``--mixed N`` adds N requests of random lengths. With ``--profile`` it also prints
cProfile's top entries of the engine's thread: where a step's host time goes (graph building, kernel launches
inside ``mx.async_eval``, KV bookkeeping). ``--compare-projections N`` measures what joining each layer's
projections is worth (``stage_worker.model.fused_projections``), ``--compare-launch N`` what a launch thread is
worth: the two arms in turns for N rounds, with each round's ratios and their median.

It is a tool for GPU backends: the weights run as loaded (a quantized checkpoint stays quantized) and no
BLAS is preloaded, so on the CPU backend it does not reproduce a stage's fast path (``stagemesh bench pipeline
--bare 1,16`` does); the report says which BLAS and weights it ran with.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stagemesh.bench import flags
from stagemesh.bench.random_checkpoint import check_shape_flags, write_shape_checkpoint
from stagemesh_core.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    flags.add_model_argument(parser)
    flags.add_shape_flags(parser)
    flags.add_dtype(parser)
    flags.add_lengths(parser, input_len=32, output_len=128)
    parser.add_argument("--streams", type=int, default=16, metavar="N",
                        help="requests at once in the second run (default %(default)s)")
    parser.add_argument("--mixed", type=int, default=0, metavar="N",
                        help="also run N requests of random prompt (1..--mixed-max-prompt) and output "
                             "(1..--output-len) lengths, --streams in flight")
    parser.add_argument("--mixed-max-prompt", type=int, default=512, metavar="N",
                        help="longest prompt of a --mixed request (default %(default)s)")
    flags.add_seed(parser)
    parser.add_argument("--profile", action="store_true", help="print cProfile's top entries of both runs")
    parser.add_argument("--compare-projections", type=int, default=0, metavar="N",
                        help="instead: N rounds in turns on two copies of the model (twice its memory), one with "
                             "mlx-lm's separate projections and one joined, with each round's joined/separate "
                             "ratios and their median")
    parser.add_argument("--compare-launch", type=int, default=0, metavar="N",
                        help="instead: N rounds in turns on one copy of the model, its steps launched by the engine's "
                             "thread and by a launch thread of their own (STAGEMESH_LAUNCH_THREAD), with each "
                             "round's ratios and their median")


def run(args: argparse.Namespace) -> int:
    import os

    from stage_worker.model.blas import reexec_with_optimized_blas
    from stage_worker.service.process_setup import serving_mlx_environment

    # As a stage sets MLX's CUDA backend (before its first GPU work); a variable already set wins.
    os.environ.update(serving_mlx_environment(os.environ))
    import mlx.core as mx

    from stage_worker.checkpoint.default_model import resolve_model_path
    from stage_worker.checkpoint.model_reader import read_model_spec
    from stage_worker.engine.entry_engine import step_ahead_pays
    from stage_worker.engine.launcher import launcher_wanted, plain_kv_caches
    from stage_worker.engine.warmup import warm_up, warmup_plan
    from stage_worker.model.device import current_backend
    from stage_worker.model.expert_routing import policy_for
    from stage_worker.model.fused_projections import fusion_wanted
    from stage_worker.model.masked_decode_kernel import decode_kernel_wanted
    from stage_worker.model.stage_model import StageModel, StageRole, resolve_compute_dtype
    from stagemesh.bench.report import build_report, emit, flags_of, now
    from stagemesh_core import defaults, settings
    from stagemesh_core.layer_split import LayerRange

    if min(args.output_len, args.streams, args.input_len, args.mixed_max_prompt) < 1 or args.mixed < 0:
        raise UserError("--output-len, --streams, --input-len and --mixed-max-prompt must be positive, "
                        "--mixed not negative")
    check_shape_flags(args)
    if args.compare_projections < 0 or (args.compare_projections and args.profile):
        raise UserError("--compare-projections takes a positive count of rounds, without --profile")
    if args.compare_launch < 0 or (args.compare_launch and (args.profile or args.compare_projections)):
        raise UserError("--compare-launch takes a positive count of rounds, without --profile or "
                        "--compare-projections")
    # As a stage does (stage_worker.service.process_setup): MLX's CPU kernels with the optimized BLAS, if any;
    # without it a Linux CPU engine would be timed on MLX's reference BLAS, several times slower than a stage.
    reexec_with_optimized_blas(["-m", "stagemesh.cli", *sys.argv[1:]], None)
    started_at = now()
    with tempfile.TemporaryDirectory(prefix="stagemesh-bench-engine-") as tmp:
        if args.shape:
            model_path = write_shape_checkpoint(args, Path(tmp))
        else:
            model_path = resolve_model_path(args.model)
        spec = read_model_spec(model_path)
        backend = current_backend()
        dtype = resolve_compute_dtype(args.dtype, backend)
        step_ahead = step_ahead_pays(backend)
        # The stage's own warm-up at load, sized as serve sizes it by default: what a user's first
        # requests find (anything it leaves cold shows in the first run below).
        warmup = warmup_plan(backend, max_num_seqs=defaults.MAX_NUM_SEQS, micro_batches=1,
                             max_batch_tokens=defaults.MAX_BATCH_TOKENS, max_model_len=defaults.MAX_MODEL_LEN)

        def load() -> StageModel:
            return StageModel.load(spec, StageRole(LayerRange(0, spec.num_layers), True, True), dtype)

        def measure(model: StageModel, launch: bool | None = None) -> dict[str, dict]:
            """The runs on ``model``; ``launch``: with a launch thread or without (None: as a stage decides)."""
            if launch is None:
                launch = launcher_wanted(settings.LAUNCH_THREAD, backend, True, plain_kv_caches(model.new_caches()),
                                         False, False)
            if not (args.compare_projections or args.compare_launch):
                warm_up(model, warmup)
            else:
                # Both arms start alike: an empty allocator cache, then one unmeasured run of the streams'
                # shapes; otherwise the arm measured second finds buffers and kernels the first one made.
                mx.clear_cache()
                _drive(model, args.streams, min(args.output_len, 16), args.input_len, step_ahead, launch, False)
            runs = {"single_stream": _drive(model, 1, args.output_len, args.input_len, step_ahead, launch,
                                            args.profile),
                    "streams": _drive(model, args.streams, args.output_len, args.input_len, step_ahead, launch,
                                      args.profile)}
            if args.mixed:
                runs["mixed"] = _drive_mixed(model, args.mixed, args.streams, args.mixed_max_prompt, args.output_len,
                                             args.seed, step_ahead, launch, args.profile)
            return runs

        def load_as_a_stage() -> tuple[StageModel, bool]:
            model = load()
            fused = fusion_wanted(settings.FUSE_PROJECTIONS, backend)  # as a stage does
            if fused:
                model.fuse_projections()
            model.route_experts(policy_for(settings.ALL_EXPERTS_ROWS, backend))  # as a stage does
            model.fused_decode = decode_kernel_wanted(settings.DECODE_KERNEL, backend)  # as a stage does
            return model, fused

        comparison: list[dict[str, Any]] = []
        if args.compare_projections:
            # Two copies side by side, measured in turns (the order swapped each round): a GPU host's speed
            # drifts within minutes, and turns make the drift hit both arms alike. On a GPU this one process
            # is steadier than two servers sharing the device (docs/performance.md).
            arms: dict[str, StageModel] = {}
            for arm in ("separate", "joined"):
                model = load()
                model.route_experts(policy_for(settings.ALL_EXPERTS_ROWS, backend))  # as a stage does
                model.fused_decode = decode_kernel_wanted(settings.DECODE_KERNEL, backend)
                if arm == "joined":
                    fused_layers = model.fuse_projections()
                warm_up(model, warmup)
                arms[arm] = model
            for round_number in range(args.compare_projections):
                order = ("separate", "joined") if round_number % 2 == 0 else ("joined", "separate")
                measured = {arm: measure(arms[arm]) for arm in order}
                comparison.append({"separate": measured["separate"], "joined": measured["joined"],
                                   "joined_in_every_layer": {"qkv": fused_layers.qkv, "gate_up": fused_layers.gate_up},
                                   "joined_over_separate": speed_ratios(measured["separate"], measured["joined"])})
            del arms, model
        launch_turns: list[dict[str, Any]] = []
        if args.compare_launch:
            model, fused = load_as_a_stage()
            warm_up(model, warmup)
            for round_number in range(args.compare_launch):
                launch_order = (False, True) if round_number % 2 == 0 else (True, False)
                by_launch = {launch: measure(model, launch) for launch in launch_order}
                launch_turns.append({"engine_thread": by_launch[False], "launch_thread": by_launch[True]})
        runs: dict[str, dict] = {}
        if not comparison and not launch_turns:
            model, fused = load_as_a_stage()
            runs = measure(model)
    from stage_worker.model.blas import loaded_blas
    from stage_worker.transport.wire import dtype_name

    config = {**flags_of(args), "model": args.shape or spec.default_served_name, "dtype": dtype_name(dtype),
              "blas": loaded_blas(), "step_ahead": step_ahead}
    results: dict[str, Any]
    if launch_turns:
        results = {"launch": launch_turns, "quantized": model.quantized, "fused_projections": fused}
        ratios = [{"round": i, "compares": "launch thread / engine thread",
                   **speed_ratios(turn["engine_thread"], turn["launch_thread"])}
                  for i, turn in enumerate(launch_turns, 1)]
        ratios.append(_median_round(ratios, "launch thread / engine thread"))
    elif comparison:
        results = {"projections": [{k: v for k, v in pair.items() if k != "joined_over_separate"}
                                   for pair in comparison]}
        ratios = [{"round": i, "compares": "joined / separate projections", **pair["joined_over_separate"]}
                  for i, pair in enumerate(comparison, 1)]
        ratios.append(_median_round(ratios, "joined / separate projections"))
    else:
        results = {"quantized": model.quantized, "fused_projections": fused,
                   **{name: {k: v for k, v in run.items() if k != "profile"} for name, run in runs.items()}}
        ratios = []
    report = build_report("engine", started_at=started_at, config=config, results=results, ratios=ratios,
                          local_mlx=True)
    labels = {"single_stream": "one stream", "streams": f"{args.streams} streams",
              "mixed": f"{args.mixed} mixed requests"}
    profiles = [f"--- engine thread, {labels[name]}:\n{run['profile']}" for name, run in runs.items()
                if run.get("profile")]
    if args.json:  # stdout holds the report alone
        for profile in profiles:
            print(profile, file=sys.stderr)
    emit(report, args, "\n".join([format_engine(report), *profiles]))
    return 0


def format_engine(report: dict[str, Any]) -> str:
    """The engine's figures as text (pure)."""
    config, results = report["config"], report["results"]
    lines = [f"{config['model']}: backend {report['environment']['backend']}, {config['dtype']}, "
             f"BLAS {config['blas']}, step ahead {config['step_ahead']}"]

    def figures(runs: dict[str, Any]) -> list[str]:
        one, many = runs["single_stream"], runs["streams"]
        out = [f"one stream: {one['ms_per_token_p50']} ms per token (p50), first token {one['first_token_ms']} ms, "
               f"slowest gap {one['slowest_gap_ms']} ms",
               f"{many['streams']} streams: {many['tokens_per_s']} tokens/s"]
        if "mixed" in runs:
            mixed = runs["mixed"]
            out.append(f"{mixed['requests']} mixed requests: {mixed['tokens_per_s']} tokens/s, TTFT p50 "
                       f"{mixed['ttft_p50_ms']} ms, p90 {mixed['ttft_p90_ms']} ms, {mixed['failed']} failed")
        return out

    arms = {"projections": (("separate", "separate projections"), ("joined", "joined projections")),
            "launch": (("engine_thread", "launched by the engine thread"), ("launch_thread", "launch thread"))}
    turns = next((kind for kind in arms if kind in results), None)
    if turns is not None:
        for i, pair in enumerate(results[turns], 1):
            for arm, label in arms[turns]:
                lines += [f"round {i}, {label}:", *(f"  {line}" for line in figures(pair[arm]))]
        for ratio in report["ratios"]:
            values = ", ".join(f"{k} {v:.3f}x" for k, v in ratio.items() if k not in ("round", "compares"))
            lines.append(f"round {ratio['round']}, {ratio['compares']}: {values}")
    else:
        lines.append(f"quantized {results['quantized']}, fused projections {results['fused_projections']}")
        lines += figures(results)
    return "\n".join(lines)


def speed_ratios(before: dict[str, dict], after: dict[str, dict]) -> dict[str, float]:
    """Each run's speed in ``after`` over ``before`` (> 1: ``after`` is faster; pure)."""
    ratios = {"single_stream": before["single_stream"]["ms_per_token_p50"]
              / after["single_stream"]["ms_per_token_p50"],
              "streams": after["streams"]["tokens_per_s"] / before["streams"]["tokens_per_s"]}
    if "mixed" in after:
        ratios["mixed"] = after["mixed"]["tokens_per_s"] / before["mixed"]["tokens_per_s"]
    return {k: round(v, 3) for k, v in ratios.items()}


def _median_round(ratios: list[dict[str, Any]], compares: str) -> dict[str, Any]:
    """The rounds' median of each ratio, as one more entry of the report's ratios (pure)."""
    return {"round": "median", "compares": compares,
            **{key: round(statistics.median(r[key] for r in ratios), 3) for key in ratios[0]
               if key not in ("round", "compares")}}


def _engine(model: Any, seats: int, max_model_len: int, step_ahead: bool, launch: bool) -> Any:
    from stage_worker.engine.entry_engine import EntryEngine
    from stage_worker.engine.launcher import KernelLauncher
    from stage_worker.engine.scheduler import Scheduler
    from stage_worker.engine.stage_runtime import EntryPipeline, StageCompute
    from stage_worker.engine.stage_status import StageStatus

    # Made on this thread, which runs the engine: its graphs are then evaluated on the launcher's thread.
    launcher = KernelLauncher() if launch else None
    pipeline = EntryPipeline(StageCompute(model, seats), None, None, is_last=True, launcher=launcher)
    scheduler = Scheduler(max_num_seqs=seats, max_model_len=max_model_len, max_waiting=seats)
    return EntryEngine(pipeline, scheduler, StageStatus(), step_ahead=step_ahead)


def _drive_mixed(model: Any, requests: int, streams: int, max_prompt: int, max_tokens: int, seed: int,
                 step_ahead: bool, launch: bool, profile: bool) -> dict:
    """``requests`` of seeded random lengths, ``streams`` in flight, one submitted as one ends."""
    import random

    from stage_worker.engine.entry_engine import RequestFailed
    from stage_worker.engine.scheduler import GenerationRequest

    rng = random.Random(seed)
    lengths = [(rng.randint(1, max_prompt), rng.randint(1, max_tokens)) for _ in range(requests)]
    engine = _engine(model, max(64, streams), max_prompt + max_tokens + 1, step_ahead, launch)
    outcome: dict[str, Any] = {"failures": [], "ttft_s": [], "tokens": []}  # lists: appends are thread-safe

    def one(index: int, prompt_len: int, out_len: int) -> None:
        start = 1000 + 7 * index
        sent = time.perf_counter()
        handle = engine.submit(GenerationRequest(f"m{index}", tuple(range(start, start + prompt_len)), out_len,
                                                 ignore_eos=True))
        received = 0
        while True:
            event = handle.events.get(timeout=300)
            if isinstance(event, RequestFailed):
                outcome["failures"].append(event.message)
                break
            if not received and event.token_ids:
                outcome["ttft_s"].append(time.perf_counter() - sent)
            received += len(event.token_ids)
            if event.finish is not None:
                break
        outcome["tokens"].append(received)

    pending = deque(enumerate(lengths))

    def worker() -> None:
        while pending:
            try:
                index, (prompt_len, out_len) = pending.popleft()
            except IndexError:  # another worker took the last one
                return
            one(index, prompt_len, out_len)

    def client() -> None:
        outcome["seconds"] = run_threads(worker, streams)

    profile_text = None
    try:
        profile_text = drive_engine(engine, client, profile)
    except Exception as exc:  # noqa: BLE001 - reported: a crash of the loop is the finding
        outcome["failures"].append(f"engine loop: {type(exc).__name__}: {exc}")
    ttft = sorted(outcome["ttft_s"])
    return {"requests": requests, "streams": streams, "max_prompt": max_prompt, "max_tokens": max_tokens,
            "tokens": sum(outcome["tokens"]), "failed": len(outcome["failures"]),
            "failures": sorted(set(outcome["failures"]))[:5],
            "tokens_per_s": round(sum(outcome["tokens"]) / outcome["seconds"], 1) if "seconds" in outcome else None,
            "ttft_p50_ms": round(ttft[len(ttft) // 2] * 1e3, 1) if ttft else None,
            "ttft_p90_ms": round(ttft[int(len(ttft) * 0.9)] * 1e3, 1) if ttft else None,
            **({"profile": profile_text} if profile_text else {})}


def _drive(model: Any, streams: int, tokens: int, prompt_len: int, step_ahead: bool, launch: bool,
           profile: bool) -> dict:
    from stage_worker.engine.scheduler import GenerationRequest

    engine = _engine(model, max(64, streams), prompt_len + tokens + 1, step_ahead, launch)
    stamps: list[float] = []
    outcome: dict[str, Any] = {}

    def client() -> None:
        started = outcome["started"] = time.perf_counter()
        handles = [engine.submit(GenerationRequest(f"r{i}", tuple(range(100 + i, 100 + i + prompt_len)), tokens,
                                                   ignore_eos=True)) for i in range(streams)]
        for handle in handles:
            while True:
                event = handle.events.get(timeout=120)
                stamps.append(time.perf_counter())
                if getattr(event, "finish", True) is not None:
                    break
        outcome["seconds"] = time.perf_counter() - started

    profile_text = drive_engine(engine, client, profile)
    if "seconds" not in outcome:
        raise RuntimeError("the engine stopped before every request finished")
    result: dict[str, Any] = {"streams": streams, "tokens": streams * tokens,
                              "tokens_per_s": round(streams * tokens / outcome["seconds"], 1)}
    if streams == 1:
        gaps = sorted(b - a for a, b in zip(stamps, stamps[1:]))
        result["ms_per_token_p50"] = round(gaps[len(gaps) // 2] * 1e3, 3) if gaps else None
        # Kernels the warm-up left cold show here: the first token and the slowest gap.
        result["first_token_ms"] = round((stamps[0] - outcome["started"]) * 1e3, 1) if stamps else None
        result["slowest_gap_ms"] = round(gaps[-1] * 1e3, 1) if gaps else None
    if profile_text:
        result["profile"] = profile_text
    return result


def run_threads(target: Callable[[], None], count: int) -> float:
    """Run ``target`` on ``count`` threads at once; the seconds until the last one returned."""
    started = time.perf_counter()
    threads = [threading.Thread(target=target) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started


def drive_engine(engine: Any, client: Callable[[], None], profile: bool = False) -> str | None:
    """Run ``engine`` on this thread (MLX's streams belong to the thread that made them) while ``client``
    drives it from another, and stop it once ``client`` returns; cProfile's top entries of the engine
    thread when ``profile``. A crash of the loop propagates after the client ends."""

    def client_then_stop() -> None:
        try:
            client()
        finally:
            engine.stop()

    thread = threading.Thread(target=client_then_stop, name="bench-client")
    thread.start()
    profiler = cProfile.Profile() if profile else None
    try:
        if profiler is not None:
            profiler.enable()
        engine.run()
    finally:
        if profiler is not None:
            profiler.disable()
        engine.stop()
        thread.join()
    if profiler is None:
        return None
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    return text.getvalue()
