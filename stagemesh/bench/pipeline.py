"""``stagemesh bench pipeline``: per-stage memory and single-stream decode speed, PP=1..N vs mlx_lm.

In one invocation, alternating so machine noise hits every arm alike, it runs:

* ``mlx_lm``: the model converted to an mlx-lm directory (same weights), loaded
  by mlx_lm and decoded greedily with its own ``generate_step`` in a fresh
  process (the reference);
* stagemesh pipelines of 1..``--max-pp`` stages over the MLX ring on loopback,
  each stage a fresh process reporting its peak resident memory.

Every arm decodes ``--output-len`` tokens from the same prompt, ignoring EOS,
``--rounds`` times; medians are reported. It prints decode tokens/s with
ratios to mlx_lm and to PP=1, and each stage's peak RSS with its ratio to the
PP=1 stage; the report holds every sample too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

from stagemesh.bench import flags
from stagemesh_core import settings
from stagemesh_core.errors import UserError

_MLX_LM_ARM = """
import json, sys, time
import mlx.core as mx
from stage_worker.service.memory import peak_rss_bytes
from mlx_lm import load
from mlx_lm.generate import generate_step
model, tokenizer = load(sys.argv[1])
prompt = mx.array(json.loads(sys.argv[2]))
max_tokens = int(sys.argv[3])
stamps = []
for token, _ in generate_step(prompt, model, max_tokens=max_tokens):
    stamps.append(time.perf_counter())
print(json.dumps({"decode_tokens_per_s": (len(stamps) - 1) / (stamps[-1] - stamps[0]),
                  "peak_rss_bytes": peak_rss_bytes()}))
"""


_BARE_ARM = """
import json, sys, time
import mlx.core as mx
from stagemesh_core.layer_split import LayerRange
from stage_worker.model.blas import loaded_blas
from stage_worker.checkpoint.model_reader import read_model_spec
from stage_worker.model.stage_model import StageModel, StageRole, resolve_compute_dtype
from mlx_lm.models.cache import KVCache
spec = read_model_spec(sys.argv[1])
batch, steps, dense = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
input_len, output_len = int(sys.argv[6]), int(sys.argv[7])
model = StageModel.load(spec, StageRole(LayerRange(0, spec.num_layers), True, True), resolve_compute_dtype(sys.argv[5]))
if dense:
    model.dequantize()
layers = model.layers

def prefill(prompt_len):
    caches = [KVCache() for _ in layers]
    # A distinct prompt per row: identical rows would route every row of a mixture-of-experts layer to
    # the same few experts, a far cheaper step than the distinct sequences a server batches.
    prompt = mx.random.randint(1, 1000, (batch, prompt_len), dtype=mx.int32, key=mx.random.key(prompt_len))
    h = model.embed(prompt)
    for layer, cache in zip(layers, caches):
        h = layer(h, "causal", cache=cache)
    token = mx.argmax(model.logits(h[:, -1]), axis=-1).astype(mx.int32)
    mx.eval(token)
    return caches, token

def step(token, caches):
    h = model.embed(token[:, None])
    for layer, cache in zip(layers, caches):
        h = layer(h, None, cache=cache)
    return mx.argmax(model.logits(h[:, -1]), axis=-1).astype(mx.int32)

def decode(caches, token, count):
    # As mlx_lm.generate_step does: the next step is queued before this one's tokens are read back.
    if count <= 0:
        return
    pending = step(token, caches)
    mx.async_eval(pending)
    for _ in range(count - 1):
        following = step(pending, caches)
        mx.async_eval(following)
        pending.tolist()
        pending = following
    pending.tolist()

caches, token = prefill(9)
started = time.perf_counter()
decode(caches, token, steps)
decode_tps = batch * steps / (time.perf_counter() - started)
# The serving benchmark's workload with nothing else: every prompt prefilled in one batch, then
# output_len - 1 batched decode steps (the first token comes from the prefill).
started = time.perf_counter()
caches, token = prefill(input_len)
decode(caches, token, output_len - 1)
workload_tps = batch * output_len / (time.perf_counter() - started)
print(json.dumps({"decode_tokens_per_s": decode_tps, "workload_tokens_per_s": workload_tps,
                  "input_len": input_len, "output_len": output_len, "blas": loaded_blas(), "dense": dense}))
"""


def bare_forward(model_path: str, batch: int, steps: int, dtype: str = "auto", input_len: int = 32,
                 output_len: int = 48, mlx_environment: Mapping[str, str] | None = None) -> dict:
    """The backend's limit: mlx-lm's own layers on a same-length batch of distinct prompts, no server, no scheduler,
    with the same BLAS and weight choice a stage would make. Two figures: decode steps alone, and
    the serving benchmark's whole workload (``input_len`` prompts prefilled together, ``output_len``
    tokens each). MLX runs with its defaults unless ``mlx_environment`` sets its variables (e.g. a stage's
    ``process_setup.SERVING_MLX_CUDA_DEFAULTS``)."""
    from stage_worker.model.blas import blas_environment, find_optimized_blas

    library = find_optimized_blas()
    env = {**blas_environment(os.environ, library, os.cpu_count()), **(mlx_environment or {})}
    dense = "1" if library else "0"
    out = subprocess.run([sys.executable, "-c", _BARE_ARM, model_path, str(batch), str(steps), dense, dtype,
                          str(input_len), str(output_len)], capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    flags.add_model_argument(parser, "a GGUF file, converted for the mlx_lm reference")
    parser.add_argument("--max-pp", type=int, default=3, help="measure PP=1..MAX_PP (default %(default)s)")
    flags.add_lengths(parser, input_len=None, output_len=128, with_input=False)
    parser.add_argument("--prompt", default="Write a short story about a lighthouse keeper.",
                        help="the prompt every arm decodes from")
    flags.add_dtype(parser)
    flags.add_rounds(parser, 3)
    parser.add_argument("--ring-base-port", type=int, default=None,
                        help=f"default $STAGEMESH_RING_BASE_PORT or {settings.RING_BASE_PORT}")
    parser.add_argument("--bare", default="",
                        help="also measure the bare batched forward of our weights at these batch sizes, "
                             "e.g. 1,16 (the backend's limit for serving comparisons)")
    parser.add_argument("--bare-input-len", type=int, default=32,
                        help="prompt tokens of the bare workload (default %(default)s)")
    parser.add_argument("--bare-output-len", type=int, default=48,
                        help="output tokens of the bare workload (default %(default)s)")


def _run_pipeline_arm(model_path: str, num_layers: int, pp: int, dtype: str, prompt: list[int],
                      max_tokens: int, ring_base: int) -> dict:
    from coordinator.local_launcher import start_local_pipeline
    from stagemesh_core.plan import make_local_plan

    plan = make_local_plan(model_path, num_layers, pp, dtype, ring_base_port=ring_base)
    with tempfile.TemporaryDirectory(prefix="stagemesh-bench-") as workdir:
        pipeline = start_local_pipeline(plan, job={"prompts": [prompt], "max_tokens": max_tokens},
                                        stats=True, workdir=workdir)
        pipeline.wait(1800)
        result = json.loads(Path(workdir, "result.json").read_text())
        stages = [json.loads(Path(workdir, f"stats-{r}.json").read_text()) for r in range(pp)]
    return {"decode_tokens_per_s": result["decode_tokens_per_s"], "stages": stages}


def _run_mlx_lm_arm(mlx_dir: str, prompt: list[int], max_tokens: int) -> dict:
    out = subprocess.run([sys.executable, "-c", _MLX_LM_ARM, mlx_dir, json.dumps(prompt), str(max_tokens)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(args: argparse.Namespace) -> int:
    from stage_worker.checkpoint.convert import convert_gguf_to_mlx_dir
    from stage_worker.checkpoint.default_model import resolve_model_path
    from stage_worker.checkpoint.model_reader import read_model_spec
    from stage_worker.checkpoint.tokenizer import load_tokenizer
    from stagemesh.bench.report import build_report, emit, flags_of, now

    if min(args.max_pp, args.output_len, args.rounds) < 1:
        raise UserError("--max-pp, --output-len and --rounds must be positive")
    started_at = now()
    model_path = resolve_model_path(args.model)
    spec = read_model_spec(model_path)
    if spec.format != "gguf":
        raise UserError("stagemesh bench pipeline converts a GGUF model for the mlx_lm reference; pass a GGUF file")
    prompt = load_tokenizer(spec).encode(args.prompt, add_special_tokens=False)
    base = args.ring_base_port or settings.RING_BASE_PORT
    arms = ["mlx_lm"] + [f"pp{n}" for n in range(1, args.max_pp + 1)]
    samples: dict[str, list[dict]] = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory(prefix="stagemesh-mlx-") as mlx_dir:
        convert_gguf_to_mlx_dir(model_path, mlx_dir)
        for round_no in range(args.rounds):
            for arm in arms:
                if arm == "mlx_lm":
                    sample = _run_mlx_lm_arm(mlx_dir, prompt, args.output_len)
                else:
                    sample = _run_pipeline_arm(model_path, spec.num_layers, int(arm[2:]), args.dtype,
                                               prompt, args.output_len, base)
                samples[arm].append(sample)
                print(f"round {round_no + 1}/{args.rounds} {arm}: "
                      f"{sample['decode_tokens_per_s']:.2f} tok/s", file=sys.stderr)
    bare = {}
    for size in [int(b) for b in args.bare.split(",") if b.strip()]:
        result = bare[f"batch{size}"] = bare_forward(model_path, size, 32, args.dtype, args.bare_input_len,
                                                     args.bare_output_len)
        print(f"bare batched forward, batch {size}: decode {result['decode_tokens_per_s']:.1f} tok/s, "
              f"whole workload ({args.bare_input_len} in, {args.bare_output_len} out) "
              f"{result['workload_tokens_per_s']:.1f} tok/s ({result['blas']} BLAS)", file=sys.stderr)
    summary = summarize(samples)
    ratios = pipeline_ratios(summary)
    report = build_report("pipeline", started_at=started_at, local_mlx=True,
                          config={**flags_of(args), "model": model_path},
                          results={"prompt_tokens": len(prompt), "summary": summary, "bare_forward": bare,
                                   "samples": samples},
                          ratios=ratios)
    emit(report, args, format_table(summary, ratios))
    return 0


def summarize(samples: dict[str, list[dict]]) -> dict:
    """Medians per arm: decode tokens/s and each stage's peak RSS (pure)."""
    summary: dict = {}
    for arm, runs in samples.items():
        entry: dict = {"decode_tokens_per_s": statistics.median(s["decode_tokens_per_s"] for s in runs)}
        if arm == "mlx_lm":
            entry["peak_rss_bytes"] = [statistics.median(s["peak_rss_bytes"] for s in runs)]
        else:
            ranks = len(runs[0]["stages"])
            entry["peak_rss_bytes"] = [statistics.median(s["stages"][r]["peak_rss_bytes"] for s in runs)
                                       for r in range(ranks)]
            entry["weight_bytes"] = [runs[0]["stages"][r]["weight_bytes"] for r in range(ranks)]
        summary[arm] = entry
    return summary


def pipeline_ratios(summary: dict) -> list[dict]:
    """Each arm's decode tokens/s over mlx_lm's and over PP=1's, and each of its stages' peak RSS over the
    PP=1 stage's (pure)."""
    pp1 = summary.get("pp1")
    out = []
    for arm, entry in summary.items():
        ratio = {"arm": arm, "vs_mlx_lm": entry["decode_tokens_per_s"] / summary["mlx_lm"]["decode_tokens_per_s"]}
        if pp1:
            ratio["vs_pp1"] = entry["decode_tokens_per_s"] / pp1["decode_tokens_per_s"]
            if arm != "mlx_lm":
                ratio["rss_vs_pp1"] = [r / pp1["peak_rss_bytes"][0] for r in entry["peak_rss_bytes"]]
        out.append(ratio)
    return out


def format_table(summary: dict, ratios: list[dict]) -> str:
    lines = [f"{'arm':<8} {'decode tok/s':>12} {'vs mlx_lm':>9} {'vs PP=1':>8}  per-stage peak RSS MB (ratio to PP=1)"]
    for ratio in ratios:
        e = summary[ratio["arm"]]
        rss = ", ".join(
            f"{b / 1e6:.0f}" + (f" ({ratio['rss_vs_pp1'][i]:.2f})" if "rss_vs_pp1" in ratio else "")
            for i, b in enumerate(e["peak_rss_bytes"])
        )
        lines.append(f"{ratio['arm']:<8} {e['decode_tokens_per_s']:>12.2f} {ratio['vs_mlx_lm']:>9.2f} "
                     f"{ratio.get('vs_pp1', float('nan')):>8.2f}  {rss}")
    return "\n".join(lines)
