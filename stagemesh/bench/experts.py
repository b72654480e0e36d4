"""``stagemesh bench experts``: one mixture-of-experts block, gathered per routed pair against every expert.

Builds the first expert block (mlx-lm's ``SwitchGLU``, with the model's own activation and biases) of a
shipped ``--shape`` with random weights of ``--dtype`` on the default device (the GPU where there is one), and
for each row count in ``--rows`` (the rows of one call: a decode step of that many sequences) times the
block both ways a stage can run it (``stage_worker.model.expert_routing``): ``gathered`` as mlx-lm runs it
(``gather_mm`` over the pairs the router picked) and ``all_experts`` (every expert on every row, then the
picked pairs). Each row's experts are drawn uniformly without repeats, as a router of random weights picks
them. Each figure is the median of ``--iters`` evaluations after ``--warmup``; the report's ratios give the
gathered time over the all-experts time (above 1: all experts is faster) and the largest difference between
the two outputs relative to the output's largest value.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from stagemesh.bench import flags
from stagemesh_core.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", default="qwen3-30b-a3b", metavar="NAME",
                        help=f"{flags.HELP['--shape']}; here one with experts, whose first expert block is timed "
                             "(default %(default)s)")
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,128,256",
                        help="rows per call, comma-separated (default %(default)s)")
    flags.add_dtype(parser)
    parser.add_argument("--iters", type=int, default=50, help="measured calls per row count and arm "
                                                              "(default %(default)s)")
    flags.add_warmup(parser, 5, "N calls per row count and arm")


def run(args: argparse.Namespace) -> int:
    from stagemesh.bench.report import build_report, emit, flags_of, now

    rows = [int(r) for r in args.rows.split(",") if r.strip()]
    if not rows or min(rows) < 1 or args.iters < 1 or args.warmup < 0:
        raise UserError("--rows and --iters must be positive, --warmup not negative")
    started_at = now()
    block, shape = _first_expert_block(args.shape, args.dtype)
    results = {**shape, "rows": [_time_rows(block, n, shape["top_k"], args.iters, args.warmup) for n in rows]}
    ratios = [{"rows": r["rows"], "compares": "gathered / all experts time", "value": r["speedup"]}
              for r in results["rows"]]
    report = build_report("experts", started_at=started_at, local_mlx=True, config=flags_of(args),
                          results=results, ratios=ratios)
    emit(report, args, format_experts(report))
    return 0


def _first_expert_block(shape_name: str, dtype_name: str) -> tuple[Any, dict[str, Any]]:
    import importlib

    import mlx.core as mx
    from mlx_lm.models.switch_layers import SwitchGLU

    from stage_worker.checkpoint.mlx_arch import mlx_model_type
    from stage_worker.model.stage_model import resolve_compute_dtype
    from stagemesh.bench.random_checkpoint import shape_config

    config = shape_config(shape_name)
    model_type = mlx_model_type(config)
    arch = importlib.import_module(f"mlx_lm.models.{model_type}")
    # mlx-lm's own model, built lazily: only the block measured is ever evaluated.
    model = arch.Model(arch.ModelArgs.from_dict(config))
    block = next((m for _, m in model.named_modules() if isinstance(m, SwitchGLU)), None)
    if block is None:
        raise UserError(f"--shape {shape_name} has no expert blocks (SwitchGLU)")
    dtype = resolve_compute_dtype(dtype_name)
    block.set_dtype(dtype)
    mx.eval(block.parameters())
    experts, hidden, dims = block.gate_proj["weight"].shape
    top_k = next(config[key] for key in ("num_experts_per_tok", "num_experts_per_token", "moe_top_k")
                 if key in config)
    return block, {"shape": shape_name, "model_type": model_type, "experts": experts, "top_k": top_k,
                   "dims": dims, "hidden": hidden, "dtype": str(dtype).removeprefix("mlx.core."),
                   "device": str(mx.default_device())}


def _time_rows(block: Any, rows: int, top_k: int, iters: int, warmup: int) -> dict[str, Any]:
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.switch_layers import SwitchGLU

    from stage_worker.model.expert_routing import all_experts_glu

    experts, _, dims = block.gate_proj["weight"].shape
    x = mx.random.normal((rows, 1, dims)).astype(block.gate_proj["weight"].dtype)
    scores = mx.random.uniform(shape=(rows, 1, experts))
    indices = mx.argpartition(scores, kth=experts - top_k, axis=-1)[..., experts - top_k:]
    arms = {"gathered": lambda: SwitchGLU.__call__(block, x, indices),
            "all_experts": lambda: all_experts_glu(block, x, indices)}
    timings: dict[str, float] = {}
    outputs = {}
    for name, call in arms.items():
        for _ in range(warmup):
            mx.eval(call())
        samples = []
        for _ in range(iters):
            begun = time.perf_counter()
            out = call()
            mx.eval(out)
            samples.append(time.perf_counter() - begun)
        timings[name] = round(statistics.median(samples) * 1e3, 4)
        outputs[name] = out.astype(mx.float32)
    scale = mx.abs(outputs["gathered"]).max().item() or 1.0
    difference = mx.abs(outputs["gathered"] - outputs["all_experts"]).max().item() / scale
    touched = len(set(np.array(indices).reshape(-1).tolist()))
    return {"rows": rows, "experts_touched": touched, "gathered_ms_p50": timings["gathered"],
            "all_experts_ms_p50": timings["all_experts"],
            "speedup": round(timings["gathered"] / timings["all_experts"], 3) if timings["all_experts"] else None,
            "max_relative_difference": float(f"{difference:.3g}")}


def format_experts(report: dict[str, Any]) -> str:
    """One row per row count: both arms' medians in ms and their ratio (pure)."""
    r = report["results"]
    lines = [f"{r['shape']} ({r['model_type']}): {r['experts']} experts, top {r['top_k']}, {r['dims']} -> "
             f"{r['hidden']}, {r['dtype']} on {r['device']}",
             f"{'rows':>6} {'touched':>8} {'gathered ms':>12} {'all ms':>10} {'speedup':>8} {'max rel diff':>13}"]
    for row in r["rows"]:
        lines.append(f"{row['rows']:>6} {row['experts_touched']:>8} {row['gathered_ms_p50']:>12.4f} "
                     f"{row['all_experts_ms_p50']:>10.4f} {row['speedup']:>8.2f} "
                     f"{row['max_relative_difference']:>13.3g}")
    return "\n".join(lines)
