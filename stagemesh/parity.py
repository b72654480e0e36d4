"""``stagemesh parity``: PP=N must compute exactly what PP=1 computes.

Runs the same prompts through a one-stage pipeline and an N-stage pipeline over
the MLX ring on this machine (real processes, loopback), greedy, for a prefill
and ``--max-tokens - 1`` decode steps (EOS ignored, so every run has the same
length). The last stage of each run records the float32 logits of every
sampled row; the tool compares them bit for bit, and the greedy tokens, prints
``max_abs_diff=`` and the first divergence, and exits 1 on any difference.
``--load-format dummy`` checks a model's shapes with random weights (every
layout must make the same ones); prompt ids the model's vocabulary lacks are
folded into it, since random weights give tokens no meaning.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from coordinator.local_launcher import PipelineFailed, start_local_pipeline
from stage_worker.generation_job import GenerationJob
from stage_worker.model_reader import read_model_spec
from stage_worker.tokenizer import load_tokenizer
from stagemesh.core import settings
from stagemesh.core.plan import DEFAULT_RING_BASE_PORT, PipelinePlan, make_local_plan
from stagemesh.serve import add_load_format_argument, resolve_model_argument

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
class ParityReport:
    max_abs_diff: float
    tokens_equal: bool
    logits_equal: bool
    first_divergence: str | None

    @property
    def passed(self) -> bool:
        return self.tokens_equal and self.logits_equal


def run_pipeline(plan: PipelinePlan, job: GenerationJob, timeout_s: float) -> RunRecord:
    import json

    with tempfile.TemporaryDirectory(prefix="stagemesh-parity-") as workdir:
        pipeline = start_local_pipeline(plan, job=job.to_dict(), record_logits=True, workdir=workdir)
        pipeline.wait(timeout_s)
        result = json.loads(Path(workdir, "result.json").read_text())
        recorded = np.load(Path(workdir, "logits.npz"))
        return RunRecord(plan, result["outputs"], recorded["seq_ids"], recorded["positions"],
                         recorded["logits"])


def compare(reference: RunRecord, candidate: RunRecord) -> ParityReport:
    """Pure comparison of two runs of the same job."""
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
        return ParityReport(float("inf"), tokens_equal, False,
                            first or "the runs sampled different rows (shapes or positions differ)")
    diff = np.abs(reference.logits.astype(np.float64) - candidate.logits.astype(np.float64))
    max_abs = float(diff.max()) if diff.size else 0.0
    logits_equal = bool(np.array_equal(reference.logits.view(np.uint32), candidate.logits.view(np.uint32)))
    if not logits_equal and first is None:
        row = int(np.argmax(diff.reshape(diff.shape[0], -1).max(axis=1) > 0))
        first = (f"logits of sequence {int(reference.seq_ids[row])} at position "
                 f"{int(reference.positions[row])} differ (max {float(diff[row].max()):.3e})")
    return ParityReport(max_abs, tokens_equal, logits_equal, first)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="GGUF file or MLX model directory (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=2)
    parser.add_argument("--pp-layer-split", default=None,
                        help="first layer of each stage after the first, e.g. 10,20")
    parser.add_argument("--dtype", default="auto", help="compute dtype: auto, float32, float16, bfloat16")
    parser.add_argument("--max-tokens", type=int, default=33,
                        help="tokens to generate per prompt (1 from prefill + decode steps)")
    parser.add_argument("--prompt", action="append", dest="prompts",
                        help="prompt text (repeatable); default: three built-in prompts")
    parser.add_argument("--ring-base-port", type=int, default=None,
                        help=f"default $STAGEMESH_RING_BASE_PORT or {DEFAULT_RING_BASE_PORT}")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per run")
    parser.add_argument("--hop-transport", default="lane", choices=("lane", "ring"),
                        help="how the PP=N run passes hidden states between stages")
    add_load_format_argument(parser)


def run(args: argparse.Namespace) -> int:
    model_path = resolve_model_argument(args.model, args.load_format)
    spec = read_model_spec(model_path, args.load_format)
    tokenizer = load_tokenizer(spec)
    prompts = tuple(args.prompts or DEFAULT_PROMPTS)
    token_prompts = tuple(tuple(tokenizer.encode(p, add_special_tokens=False)) for p in prompts)
    if spec.random_weights:
        # A borrowed tokenizer may know more tokens than a small random model has embeddings for.
        token_prompts = tuple(tuple(t % spec.vocab_size for t in p) for p in token_prompts)
    job = GenerationJob(prompts=token_prompts, max_tokens=args.max_tokens)
    base = args.ring_base_port or settings.RING_BASE_PORT
    ref_plan = make_local_plan(model_path, spec.num_layers, 1, args.dtype, ring_base_port=base,
                               load_format=args.load_format)
    pp_plan = make_local_plan(model_path, spec.num_layers, args.pipeline_parallel_size, args.dtype,
                              layer_split=args.pp_layer_split, ring_base_port=base, load_format=args.load_format,
                              hop_transport=args.hop_transport)
    split = " ".join(str(s.layers) for s in pp_plan.stages)
    weights = ", dummy (random) weights" if spec.random_weights else ""
    print(f"model: {model_path} ({spec.model_type}, {spec.num_layers} layers{weights})")
    print(f"PP=1 vs PP={pp_plan.size} (layers {split}), {len(prompts)} prompts x "
          f"{args.max_tokens} tokens (prefill + {args.max_tokens - 1} decode steps), dtype={args.dtype}, "
          f"hidden states over the {args.hop_transport}")
    try:
        reference = run_pipeline(ref_plan, job, args.timeout)
        candidate = run_pipeline(pp_plan, job, args.timeout)
    except PipelineFailed as exc:
        print(f"FAIL: {exc}", file=sys.stderr)
        return 2
    report = compare(reference, candidate)
    rows = reference.logits.shape[0]
    print(f"compared {rows} logit rows of {reference.logits.shape[-1] if rows else 0} values")
    print(f"max_abs_diff={report.max_abs_diff:.3e}")
    print(f"logits bit-identical: {report.logits_equal}; greedy tokens identical: {report.tokens_equal}")
    for prompt, out in zip(prompts, reference.outputs):
        print(f"  {prompt!r} -> {tokenizer.decode(out)!r}")
    if report.first_divergence:
        print(f"first divergence: {report.first_divergence}")
    print("PASS" if report.passed else "FAIL")
    return 0 if report.passed else 1
