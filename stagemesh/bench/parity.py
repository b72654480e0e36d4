"""``stagemesh bench parity``: PP=N must compute exactly what PP=1 computes.

Runs the same prompts through a one-stage pipeline and an N-stage pipeline over
the MLX ring on this machine (real processes, loopback), greedy, for a prefill
and ``--output-len - 1`` decode steps (EOS ignored, so every run has the same
length). The last stage of each run records the float32 logits of every
sampled row; the tool compares them bit for bit, and the greedy tokens, prints
``max_abs_diff=`` and the first divergence, and exits 1 on any difference.
``--load-format dummy`` checks a model's shapes with random weights (every
layout must make the same ones); prompt ids the model's vocabulary lacks are
folded into it, since random weights give tokens no meaning.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stagemesh.bench import flags, random_checkpoint
from stagemesh_core import settings
from stagemesh_core.plan import DEFAULT_RING_BASE_PORT, PipelinePlan

if TYPE_CHECKING:  # NumPy and the stage's job load only when a check runs
    import numpy as np

    from stage_worker.engine.generation_job import GenerationJob

DEFAULT_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
)


@dataclass(frozen=True)
class RunRecord:
    plan: PipelinePlan
    outputs: list[list[int]]
    seq_ids: np.ndarray
    positions: np.ndarray
    logits: np.ndarray


@dataclass(frozen=True)
class ParityVerdict:
    max_abs_diff: float
    tokens_equal: bool
    logits_equal: bool
    first_divergence: str | None

    @property
    def passed(self) -> bool:
        return self.tokens_equal and self.logits_equal


def run_pipeline(plan: PipelinePlan, job: GenerationJob, timeout_s: float) -> RunRecord:
    import json

    import numpy as np

    from coordinator.local_launcher import start_local_pipeline

    with tempfile.TemporaryDirectory(prefix="stagemesh-parity-") as workdir:
        pipeline = start_local_pipeline(plan, job=job.to_dict(), record_logits=True, workdir=workdir)
        pipeline.wait(timeout_s)
        result = json.loads(Path(workdir, "result.json").read_text())
        recorded = np.load(Path(workdir, "logits.npz"))
        return RunRecord(plan, result["outputs"], recorded["seq_ids"], recorded["positions"],
                         recorded["logits"])


def compare(reference: RunRecord, candidate: RunRecord) -> ParityVerdict:
    """Pure comparison of two runs of the same job."""
    import numpy as np

    first = None
    tokens_equal = reference.outputs == candidate.outputs
    if not tokens_equal:
        for seq, (a, b) in enumerate(zip(reference.outputs, candidate.outputs)):
            for step, (ta, tb) in enumerate(zip(a, b)):
                if ta != tb:
                    first = f"sequence {seq}, generated token {step}: PP=1 gave {ta}, candidate {tb}"
                    break
            if first:
                break
    same_rows = (reference.logits.shape == candidate.logits.shape
                 and np.array_equal(reference.seq_ids, candidate.seq_ids)
                 and np.array_equal(reference.positions, candidate.positions))
    if not same_rows:
        return ParityVerdict(float("inf"), tokens_equal, False,
                            first or "the runs sampled different rows (shapes or positions differ)")
    diff = np.abs(reference.logits.astype(np.float64) - candidate.logits.astype(np.float64))
    max_abs = float(diff.max()) if diff.size else 0.0
    logits_equal = bool(np.array_equal(reference.logits.view(np.uint32), candidate.logits.view(np.uint32)))
    if not logits_equal and first is None:
        row = int(np.argmax(diff.reshape(diff.shape[0], -1).max(axis=1) > 0))
        first = (f"logits of sequence {int(reference.seq_ids[row])} at position "
                 f"{int(reference.positions[row])} differ (max {float(diff[row].max()):.3e})")
    return ParityVerdict(max_abs, tokens_equal, logits_equal, first)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    flags.add_model_argument(parser)
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=2,
                        help="stages of the run compared with PP=1 (default %(default)s)")
    parser.add_argument("--pp-layer-split", default=None,
                        help="first layer of each stage after the first, e.g. 10,20")
    flags.add_dtype(parser)
    flags.add_lengths(parser, input_len=None, output_len=33, with_input=False,
                      output_note="1 from the prefill, then decode steps")
    parser.add_argument("--prompt", action="append", dest="prompts",
                        help="prompt text (repeatable); default: three built-in prompts")
    parser.add_argument("--ring-base-port", type=int, default=None,
                        help=f"default $STAGEMESH_RING_BASE_PORT or {DEFAULT_RING_BASE_PORT}")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per run (default %(default)s)")
    parser.add_argument("--hop-transport", default="lane", choices=("lane", "ring"),
                        help="how the PP=N run passes hidden states between stages (default %(default)s)")
    random_checkpoint.add_load_format_argument(parser)


def run(args: argparse.Namespace) -> int:
    from coordinator.local_launcher import PipelineFailed
    from stage_worker.checkpoint.model_reader import read_model_spec
    from stage_worker.checkpoint.tokenizer import load_tokenizer
    from stage_worker.engine.generation_job import GenerationJob
    from stagemesh.bench.report import build_report, emit, flags_of, now
    from stagemesh.serve import resolve_model_argument
    from stagemesh_core.plan import make_local_plan

    started_at = now()
    model_path = resolve_model_argument(args.model, args.load_format)
    spec = read_model_spec(model_path, args.load_format)
    tokenizer = load_tokenizer(spec)
    prompts = tuple(args.prompts or DEFAULT_PROMPTS)
    token_prompts = tuple(tuple(tokenizer.encode(p, add_special_tokens=False)) for p in prompts)
    if spec.random_weights:
        # A borrowed tokenizer may know more tokens than a small random model has embeddings for.
        token_prompts = tuple(tuple(t % spec.vocab_size for t in p) for p in token_prompts)
    job = GenerationJob(prompts=token_prompts, max_tokens=args.output_len)
    base = args.ring_base_port or settings.RING_BASE_PORT
    ref_plan = make_local_plan(model_path, spec.num_layers, 1, args.dtype, ring_base_port=base,
                               load_format=args.load_format)
    pp_plan = make_local_plan(model_path, spec.num_layers, args.pipeline_parallel_size, args.dtype,
                              layer_split=args.pp_layer_split, ring_base_port=base, load_format=args.load_format,
                              hop_transport=args.hop_transport)
    split = " ".join(str(s.layers) for s in pp_plan.stages)
    weights = ", dummy (random) weights" if spec.random_weights else ""
    header = [f"model: {model_path} ({spec.model_type}, {spec.num_layers} layers{weights})",
              f"PP=1 vs PP={pp_plan.size} (layers {split}), {len(prompts)} prompts x "
              f"{args.output_len} tokens (prefill + {args.output_len - 1} decode steps), dtype={args.dtype}, "
              f"hidden states over the {args.hop_transport}"]
    print(f"stagemesh bench parity: {model_path}, PP=1 then PP={pp_plan.size}", file=sys.stderr)
    try:
        reference = run_pipeline(ref_plan, job, args.timeout)
        candidate = run_pipeline(pp_plan, job, args.timeout)
    except PipelineFailed as exc:
        print(f"FAIL: {exc}", file=sys.stderr)
        return 2
    outcome = compare(reference, candidate)
    rows = reference.logits.shape[0]
    results: dict[str, Any] = {
        # "inf" as a string (rows that cannot be compared): JSON has no infinity.
        "passed": outcome.passed, "max_abs_diff": outcome.max_abs_diff if math.isfinite(outcome.max_abs_diff)
        else "inf", "logits_equal": outcome.logits_equal,
        "tokens_equal": outcome.tokens_equal, "first_divergence": outcome.first_divergence,
        "logit_rows": rows, "logit_values": reference.logits.shape[-1] if rows else 0,
        "layers": [[s.layers.start, s.layers.end] for s in pp_plan.stages],
        "outputs": [{"prompt": p, "text": tokenizer.decode(out)} for p, out in zip(prompts, reference.outputs)]}
    report = build_report("parity", started_at=started_at, local_mlx=True, results=results,
                          config={**flags_of(args), "model": model_path, "random_weights": spec.random_weights})
    emit(report, args, "\n".join([*header, *format_parity(results)]))
    return 0 if outcome.passed else 1


def format_parity(results: dict[str, Any]) -> list[str]:
    """The verdict as text, PASS or FAIL last (pure)."""
    lines = [f"compared {results['logit_rows']} logit rows of {results['logit_values']} values",
             f"max_abs_diff={float(results['max_abs_diff']):.3e}",
             f"logits bit-identical: {results['logits_equal']}; greedy tokens identical: {results['tokens_equal']}",
             *(f"  {o['prompt']!r} -> {o['text']!r}" for o in results["outputs"])]
    if results["first_divergence"]:
        lines.append(f"first divergence: {results['first_divergence']}")
    return [*lines, "PASS" if results["passed"] else "FAIL"]
