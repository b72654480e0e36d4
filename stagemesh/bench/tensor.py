"""``stagemesh bench tensor``: one stage's decode as a tensor-parallel group against one process, and the ceiling.

Starts ``--tp`` processes on loopback (MLX ring ranks, every one on one BLAS thread with the optimized BLAS
preloaded, as a stage is, each standing for one Mac), loads the whole model as one stage in float32 with
dense weights, cuts it to each member's share (``stage_worker.parallel.tensor_parallel``) and times greedy
decode steps of ``--rows`` sequences at once; then one process does the same with the whole stage. A step
splits into each member's compute (the same steps with the sums left out) and the rest (all-reduces and
waiting for the slower member); rank 0 also times the group's all-reduces alone (two per layer of a
``[rows, hidden]`` array). The ceiling is this machine's own: ``--tp`` processes at once, each streaming its
share of the stage's weight bytes through a matrix product of ``rows`` rows, against one process streaming
all of them; on one host the processes share memory bandwidth, so it is well below ``--tp``. The report's
ratios: the group's tokens/s over one process's, that speed-up over the ceiling, and a member's peak memory over
its load (lazy, cut layer by layer, as a stage's worker loads) over one process's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from stagemesh.bench import flags
from stagemesh_core.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    flags.add_model_argument(parser, "(default: the embedded default model)")
    parser.add_argument("--tp", type=int, default=2, help="members of the group (default %(default)s)")
    parser.add_argument("--rows", default="1,16",
                        help="sequences decoded at once, comma-separated (default %(default)s)")
    parser.add_argument("--steps", type=int, default=32, help="measured decode steps per shape (default %(default)s)")
    flags.add_warmup(parser, 4, "N decode steps per shape")
    flags.add_port_base(parser, 29340, "one ring port per member")


def run(args: argparse.Namespace) -> int:
    from stagemesh.bench.report import build_report, emit, flags_of, now

    rows = [int(r) for r in args.rows.split(",") if r.strip()]
    if not rows or min(rows) < 1 or args.steps < 1 or args.warmup < 0 or args.tp < 2:
        raise UserError("--rows and --steps must be positive, --warmup not negative and --tp at least 2")
    started_at = now()
    config = {"model": args.model, "rows": rows, "steps": args.steps, "warmup": args.warmup}
    group = _run_ranks(args.tp, args.port_base, {**config, "mode": "decode"})
    single = _run_ranks(1, args.port_base, {**config, "mode": "decode"})
    streams = _run_ranks(args.tp, args.port_base, {**config, "mode": "stream", "bytes": single["weight_bytes"]})
    stream_one = _run_ranks(1, args.port_base, {**config, "mode": "stream", "bytes": single["weight_bytes"]})
    shapes = []
    for g, s, c, c1 in zip(group["shapes"], single["shapes"], streams["shapes"], stream_one["shapes"], strict=True):
        speedup = s["step_ms"] / g["step_ms"]
        ceiling = c1["step_ms"] / c["step_ms"]
        shapes.append({"rows": g["rows"], "tp1_step_ms": s["step_ms"], "tp_step_ms": g["step_ms"],
                       "tp_allreduce_ms": g["allreduce_ms"], "tp_compute_ms": g["compute_ms"],
                       "tp_compute_ms_by_worker": g["compute_ms_by_worker"],
                       "tp1_tokens_per_s": round(1e3 * g["rows"] / s["step_ms"], 1),
                       "tp_tokens_per_s": round(1e3 * g["rows"] / g["step_ms"], 1),
                       "speedup": round(speedup, 3), "ceiling": round(ceiling, 3),
                       "of_ceiling": round(speedup / ceiling, 3)})
    load_peak = round(group["load_peak_bytes"] / single["load_peak_bytes"], 3)
    results = {"tp": args.tp, "model": single["model"], "weight_bytes": single["weight_bytes"],
               "member_weight_bytes": group["weight_bytes"], "load_peak_bytes": single["load_peak_bytes"],
               "member_load_peak_bytes": group["load_peak_bytes"], "blas": single["blas"], "shapes": shapes}
    ratios = [{"rows": s["rows"], "compares": f"-tp {args.tp} / -tp 1 tokens/s", "value": s["speedup"]}
              for s in shapes] + [{"rows": s["rows"], "compares": "speed-up / ceiling", "value": s["of_ceiling"]}
                                  for s in shapes] + [
        {"compares": f"-tp {args.tp} member / -tp 1 peak memory over the load", "value": load_peak}]
    report = build_report("tensor", started_at=started_at, local_mlx=True,
                          config={**flags_of(args), "rows": rows, "blas_threads_per_member": 1},
                          results=results, ratios=ratios)
    emit(report, args, format_tensor(report))
    return 0


def _run_ranks(size: int, port_base: int, config: dict[str, Any]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="stagemesh-tensor-") as tmp:
        hostfile = Path(tmp) / "hosts.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{port_base + rank}"] for rank in range(size)]))
        config = {**config, "size": size, "result": str(Path(tmp) / "result.json")}
        procs = [subprocess.Popen([sys.executable, "-m", "stagemesh.bench.tensor", json.dumps(config)],
                                  env={**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)})
                 for rank in range(size)]
        codes = [p.wait(900) for p in procs]
        if any(codes):
            raise UserError(f"stagemesh bench tensor: {size} ranks exited with {codes}")
        workers = [json.loads(Path(f"{config['result']}.{rank}").read_text()) for rank in range(size)]
        result = workers[0]
        # Every worker's own compute: a step waits for the slowest, which need not be worker 0.
        for index, shape in enumerate(result["shapes"]):
            shape["compute_ms_by_worker"] = [w["shapes"][index].get("compute_ms") for w in workers]
        return result


def format_tensor(report: dict[str, Any]) -> str:
    """One row per shape: step times, the group's all-reduce share, speed-up and ceiling (pure)."""
    r = report["results"]
    lines = [f"{r['model']}, -tp {r['tp']} against -tp 1, {r['blas']} on one thread per member; member weights "
             f"{r['member_weight_bytes'] / 1e6:.0f} MB of {r['weight_bytes'] / 1e6:.0f} MB; MLX's peak over the load "
             f"(a member's: its part of each cut tensor read alone) {r['member_load_peak_bytes'] / 1e6:.0f} MB against "
             f"{r['load_peak_bytes'] / 1e6:.0f} MB",
             f"{'rows':>5} {'tp1 ms':>9} {'tp ms':>9} {'compute by worker':>18} {'allreduce':>10} {'tok/s tp1':>10} "
             f"{'tok/s tp':>9} {'speedup':>8} {'ceiling':>8} {'of ceil':>8}"]
    for s in r["shapes"]:
        by_worker = " / ".join(f"{ms:.1f}" for ms in s.get("tp_compute_ms_by_worker") or [s["tp_compute_ms"]])
        lines.append(f"{s['rows']:>5} {s['tp1_step_ms']:>9.3f} {s['tp_step_ms']:>9.3f} {by_worker:>18} "
                     f"{s['tp_allreduce_ms']:>10.3f} "
                     f"{s['tp1_tokens_per_s']:>10.1f} {s['tp_tokens_per_s']:>9.1f} {s['speedup']:>8.3f} "
                     f"{s['ceiling']:>8.3f} {s['of_ceiling']:>8.3f}")
    return "\n".join(lines)


def _median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e3, 4)


def _rank_main(config: dict[str, Any]) -> None:
    """One member (``MLX_RANK``), run as ``python -m stagemesh.bench.tensor CONFIG``; each writes its own result
    (rank 0's is the group's)."""
    from stage_worker.model.blas import reexec_with_optimized_blas

    reexec_with_optimized_blas(["-m", "stagemesh.bench.tensor", json.dumps(config)], threads=1)
    import mlx.core as mx

    from stage_worker.checkpoint.default_model import resolve_model_path
    from stage_worker.checkpoint.model_reader import read_model_spec
    from stage_worker.model.blas import loaded_blas
    from stage_worker.model.packed_forward import Segment
    from stage_worker.model.stage_model import StageModel, StageRole
    from stage_worker.parallel.tensor_parallel import AllSumLinear
    from stagemesh_core.layer_split import LayerRange

    group = mx.distributed.init(backend="ring", strict=True) if config["size"] > 1 else None
    rank = group.rank() if group is not None else 0
    spec = read_model_spec(resolve_model_path(config["model"]))
    result: dict[str, Any] = {"model": spec.default_served_name, "blas": loaded_blas(), "shapes": []}
    if config["mode"] == "stream":
        share = config["bytes"] // 4 // config["size"]
        weight = mx.random.normal((share // spec.hidden_size, spec.hidden_size)) * 0.01
        mx.eval(weight)
        for rows in config["rows"]:
            x = mx.random.normal((rows, spec.hidden_size))
            mx.eval(x)
            samples = []
            for i in range(config["warmup"] + config["steps"]):
                if group is not None:  # every member starts each product together
                    mx.eval(mx.distributed.all_sum(mx.zeros((1,)), group=group))
                started = time.perf_counter()
                mx.eval(x @ weight.T)
                if i >= config["warmup"]:
                    samples.append(time.perf_counter() - started)
            result["shapes"].append({"rows": rows, "step_ms": _median_ms(samples)})
    else:
        # As a stage's worker loads: a member lazily, cut layer by layer; one process whole.
        lazy = group is not None
        mx.reset_peak_memory()
        model = StageModel.load(spec, StageRole(LayerRange(0, spec.num_layers), True, True), mx.float32,
                                evaluate=not lazy)
        model.dequantize(evaluate=not lazy)
        if group is not None:
            model.shard(group, rank_0_extra=spec.vocab_size * spec.hidden_size)  # as a last stage shards
        result["load_peak_bytes"] = mx.get_peak_memory()
        result["weight_bytes"] = model.weight_bytes
        for rows in config["rows"]:
            caches = [model.new_caches() for _ in range(rows)]
            hidden = model.embed(mx.array(list(range(1, 1 + 8)) * rows, dtype=mx.int32))  # an 8-token prompt each
            out = model.run_packed(hidden, [Segment(c, 8, 8 * i) for i, c in enumerate(caches)])
            mx.eval(out)
            tokens = mx.argmax(model.logits(out.reshape(rows, 8, -1)[:, -1]), axis=-1)
            samples = []
            for i in range(config["warmup"] + config["steps"]):
                started = time.perf_counter()
                hidden = model.embed(tokens.astype(mx.int32))
                out = model.run_packed(hidden, [Segment(c, 1, j) for j, c in enumerate(caches)])
                tokens = mx.argmax(model.logits(out), axis=-1)
                mx.eval(tokens)
                if i >= config["warmup"]:
                    samples.append(time.perf_counter() - started)
            allreduce = []
            if group is not None:
                x = mx.zeros((rows, spec.hidden_size))
                mx.eval(x)
                for _ in range(config["steps"]):
                    started = time.perf_counter()
                    for _ in range(2 * spec.num_layers):  # o_proj's and down_proj's sums, each on its own
                        x = mx.distributed.all_sum(x, group=group)
                        mx.eval(x)
                    allreduce.append(time.perf_counter() - started)
            compute = []
            if group is not None:  # the same steps with every sum left out: the member's compute alone
                sums = [m for layer in model.layers for m in layer.modules() if isinstance(m, AllSumLinear)]
                for m in sums:
                    m.summing = False
                for i in range(config["warmup"] + config["steps"]):
                    started = time.perf_counter()
                    out = model.run_packed(model.embed(tokens.astype(mx.int32)),
                                           [Segment(c, 1, j) for j, c in enumerate(caches)])
                    mx.eval(mx.argmax(model.logits(out), axis=-1))
                    if i >= config["warmup"]:
                        compute.append(time.perf_counter() - started)
                for m in sums:
                    m.summing = True
            result["shapes"].append({"rows": rows, "step_ms": _median_ms(samples),
                                     "allreduce_ms": _median_ms(allreduce) if allreduce else 0.0,
                                     "compute_ms": _median_ms(compute) if compute else _median_ms(samples)})
    Path(f"{config['result']}.{rank}").write_text(json.dumps(result))


if __name__ == "__main__":
    _rank_main(json.loads(sys.argv[1]))
