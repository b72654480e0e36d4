"""``stagemesh bench-engine``: the entry stage alone (engine, scheduler, model), no gRPC and no gateway.

Loads a whole model as one stage (the embedded default model, or ``--shape``:
a real-sized random-weight checkpoint from ``random_checkpoint``) and drives
its ``EntryEngine`` directly from a client thread, as the stage's gRPC
handlers would: one stream of ``--tokens`` tokens (time per token, p50), then
``--streams`` streams together (tokens/s). With ``--profile`` it also prints
cProfile's top entries of the engine's thread for both runs: where a step's
host time goes (graph building, kernel launches inside ``mx.async_eval``, KV
bookkeeping). The engine runs on this process's main thread because MLX's
CUDA streams belong to the thread that made them, as in a stage.

It is a tool for GPU backends: the weights run as loaded (a quantized
checkpoint stays quantized) and no BLAS is preloaded, so on the CPU backend it
does not reproduce a stage's fast path (``stagemesh bench-pipeline --bare``
does); the JSON says which BLAS and weights it ran with.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", default=None, help="a random-weight shape (llama-3.2-1b, llama-3.1-8b, qwen3-8b); "
                                                     "default: the embedded model")
    parser.add_argument("--shape-tokenizer", default=None, help="tokenizer directory for --shape")
    parser.add_argument("--dtype", default="auto", help="compute dtype (auto: the backend's)")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per request")
    parser.add_argument("--streams", type=int, default=16, help="requests at once in the second run")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--profile", action="store_true", help="print cProfile's top entries of both runs")
    parser.add_argument("--out", default=None, help="also write the JSON here")


def run(args: argparse.Namespace) -> int:
    import mlx.core as mx

    from stage_worker.default_model import resolve_model_path
    from stage_worker.device import current_backend
    from stage_worker.engine import step_ahead_pays
    from stage_worker.model_spec import read_model_spec
    from stage_worker.stage_model import StageModel, StageRole, resolve_compute_dtype
    from stagemesh.core.layer_split import LayerRange

    if min(args.tokens, args.streams, args.prompt_len) < 1:
        print("bench-engine: --tokens, --streams and --prompt-len must be positive", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="stagemesh-bench-engine-") as tmp:
        if args.shape:
            from stagemesh.bench.random_checkpoint import shape_config, write_random_checkpoint

            model_path = str(write_random_checkpoint(shape_config(args.shape), Path(tmp) / args.shape,
                                                     tokenizer_dir=args.shape_tokenizer))
        else:
            model_path = resolve_model_path(None)
        spec = read_model_spec(model_path)
        backend = current_backend()
        dtype = resolve_compute_dtype(args.dtype, backend)
        model = StageModel.load(spec, StageRole(LayerRange(0, spec.num_layers), True, True), dtype)
        step_ahead = step_ahead_pays(backend)
        _drive(model, 1, 8, args.prompt_len, step_ahead, profile=False)  # warm the kernels
        single = _drive(model, 1, args.tokens, args.prompt_len, step_ahead, args.profile)
        many = _drive(model, args.streams, args.tokens, args.prompt_len, step_ahead, args.profile)
    from stage_worker.blas import loaded_blas
    from stage_worker.wire import dtype_name

    result = {"model": args.shape or spec.default_served_name, "backend": backend, "dtype": dtype_name(dtype),
              "quantized": model.quantized, "blas": loaded_blas(), "step_ahead": step_ahead,
              "mlx": getattr(mx, "__version__", "unknown"),
              "single_stream": {k: v for k, v in single.items() if k != "profile"},
              "streams": {k: v for k, v in many.items() if k != "profile"}}
    text = json.dumps(result, indent=1)
    print(text)
    for label, run_result in (("one stream", single), (f"{args.streams} streams", many)):
        if run_result.get("profile"):
            print(f"--- engine thread, {label}:\n{run_result['profile']}")
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


def _drive(model: Any, streams: int, tokens: int, prompt_len: int, step_ahead: bool, profile: bool) -> dict:
    from stage_worker.engine import EntryEngine
    from stage_worker.scheduler import GenerationRequest, Scheduler
    from stage_worker.stage_runtime import EntryPipeline, StageCompute
    from stage_worker.stage_status import StageStatus

    pipeline = EntryPipeline(StageCompute(model, max(64, streams)), None, None, is_last=True)
    scheduler = Scheduler(max_num_seqs=max(64, streams), max_model_len=prompt_len + tokens + 1,
                          max_waiting=max(64, streams))
    engine = EntryEngine(pipeline, scheduler, StageStatus(), step_ahead=step_ahead)
    stamps: list[float] = []
    outcome: dict[str, Any] = {}

    def client() -> None:
        try:
            started = time.perf_counter()
            handles = [engine.submit(GenerationRequest(f"r{i}", tuple(range(100 + i, 100 + i + prompt_len)), tokens,
                                                       ignore_eos=True)) for i in range(streams)]
            for handle in handles:
                while True:
                    event = handle.events.get(timeout=120)
                    stamps.append(time.perf_counter())
                    if getattr(event, "finish", True) is not None:
                        break
            outcome["seconds"] = time.perf_counter() - started
        finally:
            engine.stop()

    thread = threading.Thread(target=client, name="bench-client")
    thread.start()
    profiler = cProfile.Profile() if profile else None
    if profiler is not None:
        profiler.enable()
    engine.run()
    if profiler is not None:
        profiler.disable()
    thread.join()
    if "seconds" not in outcome:
        raise RuntimeError("the engine stopped before every request finished")
    result: dict[str, Any] = {"streams": streams, "tokens": streams * tokens,
                              "tokens_per_s": round(streams * tokens / outcome["seconds"], 1)}
    if streams == 1:
        gaps = sorted(b - a for a, b in zip(stamps, stamps[1:]))
        result["ms_per_token_p50"] = round(gaps[len(gaps) // 2] * 1e3, 3) if gaps else None
    if profiler is not None:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(20)
        result["profile"] = text.getvalue()
    return result
