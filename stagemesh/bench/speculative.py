"""``stagemesh bench speculative``: what speculative decoding is worth, speculation off against on.

Loads MODEL (default: the embedded model; or ``--shape``: a real-sized random-weight checkpoint) as one stage,
as ``stagemesh bench prefix`` does, and runs one workload without and with ``--speculative-config``: chat
prompts that ask the model to repeat or edit a piece of code it is given (what prompt lookup is for), greedy,
each until end-of-sequence or ``--output-len`` tokens, at each ``--streams`` level (that many requests at
once), ``--rounds`` times per arm, the arms alternating so machine noise hits both alike. ``--pp N`` runs it
through two ``stagemesh serve -pp N`` servers instead. The "on" arm proposes by prompt lookup unless a draft
model is given: ``--draft-model PATH`` (an mlx-lm model directory; ``self``: the target's own weights, the
acceptance upper bound) or ``--draft-shape NAME`` (random weights: the cost of proposals that are rejected).
It reports each arm's output tokens per second per level (medians over rounds), the on / off ratio, whether
the two arms' greedy tokens are identical (they must be: exit 1 otherwise), the share of proposed tokens
accepted, and where a step's time goes: the target's steps by kind (``target_steps``: verifications, plain
decode steps, prompt chunks) and, with a draft model, the draft's rounds by phase (``draft``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import Any

from stagemesh.bench import flags
from stagemesh_core.errors import UserError

DEFAULT_CONFIG = '{"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4, "prompt_lookup_min": 1}'
# Code to repeat or edit: the answer quotes its input, as answers about code, documents and retrieval often do.
_CODE = [
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n\n"
    "def factorial(n):\n    result = 1\n    for i in range(2, n + 1):\n        result *= i\n    return result\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n\n"
    "    def is_empty(self):\n        return not self.items\n",
    "import json\n\n\ndef load_config(path):\n    with open(path) as f:\n        return json.load(f)\n\n\n"
    "def save_config(path, config):\n    with open(path, 'w') as f:\n        json.dump(config, f, indent=2)\n",
]
PROMPTS = [
    *[f"Repeat this code exactly, without any comment:\n\n{code}" for code in _CODE],
    f"Rename the function factorial to product_up_to in this code and show the whole code:\n\n{_CODE[0]}",
    f"Add a method peek that returns the last item to this class and show the whole class:\n\n{_CODE[1]}",
]


DEFAULT_DRAFT_CONFIG = '{"num_speculative_tokens": 4}'
SELF = "self"  # --draft-model self: the target's own weights


def add_arguments(parser: argparse.ArgumentParser) -> None:
    flags.add_model_argument(parser)
    flags.add_shape_flags(parser)
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help="the speculation of the 'on' arm, as stagemesh serve takes it (default: "
                             f"{DEFAULT_CONFIG}; with a draft model {DEFAULT_DRAFT_CONFIG}, its \"model\" set by "
                             "--draft-model or --draft-shape)")
    parser.add_argument("--draft-model", default=None, metavar="PATH",
                        help="the 'on' arm's draft model: an mlx-lm model directory, or 'self' for the target's "
                             "own weights (a GGUF target converted first)")
    parser.add_argument("--draft-shape", default=None, metavar="NAME",
                        help="the 'on' arm's draft model: a shipped shape with random weights, written with "
                             "--shape-dtype and --shape-tokenizer (a vocabulary the target shares)")
    parser.add_argument("--streams", default="1", metavar="N[,N...]",
                        help="requests at once, one level each (default %(default)s)")
    flags.add_lengths(parser, input_len=None, output_len=256, with_input=False, output_note="at most, per prompt")
    flags.add_rounds(parser, 3)
    parser.add_argument("--pp", type=int, default=None, metavar="N",
                        help="measure through two `stagemesh serve -pp N` servers (speculation off and on) and "
                             "their OpenAI API instead of one stage in this process")
    flags.add_port_base(parser, 28200, "with --pp: the servers' ports (the 'on' server 20 above)")
    flags.add_serve_args(parser)


def _streams(text: str) -> list[int]:
    try:
        levels = [int(part) for part in text.split(",")]
    except ValueError:
        raise UserError(f"--streams {text!r}: give whole numbers separated by commas, e.g. 1,16") from None
    if not levels or min(levels) < 1:
        raise UserError(f"--streams {text!r}: every level must be at least 1")
    return levels


def speculative_config_text(config_text: str | None, draft_dir: str | None) -> str:
    """The 'on' arm's ``--speculative-config`` JSON: as given (or the default), with ``draft_dir`` as its
    draft model when one is given (pure). With a draft model the flag gives the rest of the draft's config
    (``num_speculative_tokens``, ``disable_by_batch_size``: raise it to speculate at more streams)."""
    if draft_dir is None:
        return config_text or DEFAULT_CONFIG
    raw = json.loads(config_text or DEFAULT_DRAFT_CONFIG)
    if not isinstance(raw, dict):
        raise UserError(f"--speculative-config: expected a JSON object, got {config_text}")
    return json.dumps({**raw, "model": draft_dir})


def run(args: argparse.Namespace) -> int:
    from stagemesh.bench.random_checkpoint import check_shape_flags, shape_config

    if args.output_len < 1 or args.rounds < 1:
        raise UserError("--output-len and --rounds must be positive")
    if args.draft_model and args.draft_shape:
        raise UserError("give --draft-model or --draft-shape, not both")
    check_shape_flags(args)
    if args.draft_shape:
        shape_config(args.draft_shape)  # an unknown shape, named before anything is written
    streams = _streams(args.streams)
    from stage_worker.model.blas import reexec_with_optimized_blas

    # As a stage does (stage_worker.service.process_setup): MLX's CPU kernels with the optimized BLAS, if any.
    reexec_with_optimized_blas(["-m", "stagemesh.cli", *sys.argv[1:]], None)
    with tempfile.TemporaryDirectory(prefix="stagemesh-bench-speculative-") as tmp:
        return _run(args, streams, Path(tmp))


def _run(args: argparse.Namespace, streams: list[int], tmp: Path) -> int:
    from stage_worker.checkpoint.default_model import resolve_model_path
    from stage_worker.checkpoint.mlx_arch import exact_prefix_reuse
    from stage_worker.checkpoint.model_reader import read_model_spec
    from stage_worker.checkpoint.tokenizer import eos_token_ids, load_tokenizer
    from stage_worker.model.blas import loaded_blas
    from stage_worker.speculation.draft_proposer import check_draft_model, load_draft_proposer
    from stagemesh.bench.prefix import load_stage_as_served
    from stagemesh.bench.random_checkpoint import write_shape_checkpoint
    from stagemesh.bench.report import build_report, emit, flags_of, now
    from stagemesh_core.speculative import parse_speculative_config

    started_at = now()
    path = write_shape_checkpoint(args, tmp) if args.shape else str(resolve_model_path(args.model))
    spec = read_model_spec(path)
    if not exact_prefix_reuse(spec):
        raise UserError(f"{spec.model_type} keeps sliding windows or recurrent state: it does not speculate")
    draft_dir = _draft_dir(args, spec, tmp)
    config = parse_speculative_config(speculative_config_text(args.speculative_config, draft_dir))
    tokenizer = load_tokenizer(spec)
    if args.pp is not None:
        return _run_served(args, streams, path, speculative_config_text(args.speculative_config, draft_dir), tmp,
                           started_at)
    proposer = None
    if config.model is not None:
        check_draft_model(config.model, spec, tokenizer)
        proposer = load_draft_proposer(config.model, _as_served())
    model, dense = load_stage_as_served(spec)
    stops = eos_token_ids(spec, tokenizer)
    # As the gateway does (gateway.chat.template): the template's text, then its tokens.
    prompts = [tuple(tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                                    add_generation_prompt=True, tokenize=False),
                                      add_special_tokens=False)) for text in PROMPTS]
    _drive(model, prompts[:1], stops, 16, None, None, 1)  # warm the kernels
    levels, ratios = [], []
    for level in streams:
        arms: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
        outputs: dict[str, list[list[int]]] = {}
        for _ in range(args.rounds):
            for arm, speculative in (("off", None), ("on", config)):
                result = _drive(model, prompts, stops, args.output_len, speculative, proposer, level)
                outputs[arm] = result.pop("outputs")
                arms[arm].append(result)
        figures, ratio = _level_summary(level, arms, outputs)
        levels.append(figures)
        ratios.append(ratio)
    report = build_report("speculative", started_at=started_at, local_mlx=True, results={"levels": levels},
                          ratios=ratios,
                          config={**flags_of(args), "model": spec.default_served_name, "blas": loaded_blas(),
                                  "dense_weights": dense, "speculative_config": config.to_json(),
                                  "draft_weight_bytes": proposer.weight_bytes if proposer else None,
                                  "prompts": PROMPTS})
    emit(report, args, format_speculative(report))
    return 0 if all(r["identical_greedy_tokens"] for r in ratios) else 1


def _run_served(args: argparse.Namespace, streams: list[int], path: str, config_text: str, tmp: Path,
                started_at: datetime) -> int:
    """``--pp N``: the same workload through two served pipelines (``speculative_served``)."""
    from stagemesh.bench.report import build_report, emit, flags_of
    from stagemesh.bench.speculative_served import drive_served, served_arms

    levels, ratios = [], []
    with served_arms(path, args.pp, config_text, args.port_base, args.serve_args.split(),
                     tmp / "logs") as arms:
        for arm in arms:  # warm each server's kernels
            drive_served(arm, PROMPTS[:1], 16, 1)
        for level in streams:
            runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
            outputs: dict[str, list[str]] = {}
            for _ in range(args.rounds):
                for arm in arms:
                    result = drive_served(arm, PROMPTS, args.output_len, level)
                    outputs[arm.name] = result.pop("outputs")
                    runs[arm.name].append(result)
            figures, ratio = _level_summary(level, runs, outputs)
            levels.append(figures)
            ratios.append(ratio)
    report = build_report("speculative", started_at=started_at, local_mlx=False, results={"levels": levels},
                          ratios=ratios,
                          config={**flags_of(args), "model": path, "pp": args.pp,
                                  "speculative_config": json.loads(config_text), "prompts": PROMPTS})
    emit(report, args, format_speculative(report))
    return 0 if all(r["identical_greedy_tokens"] for r in ratios) else 1


def _level_summary(level: int, runs: dict[str, list[dict[str, Any]]],
                   outputs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A streams level's figures (each arm's median run) and its on / off ratio (pure)."""
    figures = {arm: _median(results) for arm, results in runs.items()}
    ratio = {"streams": level, "compares": "speculation on / off",
             "tokens_per_s": round(figures["on"]["tokens_per_s"] / figures["off"]["tokens_per_s"], 3),
             "identical_greedy_tokens": outputs["off"] == outputs["on"]}
    return {"streams": level, **figures}, ratio


def _as_served() -> Any:
    """What a stage on this machine decides its weights by (``load_stage_as_served``), for the draft."""
    import psutil

    from stage_worker.speculation.draft_proposer import DraftWeights

    return DraftWeights.on_this_machine(int(psutil.virtual_memory().total * 0.8))


def _draft_dir(args: argparse.Namespace, spec: Any, tmp: Path) -> str | None:
    """The directory of the 'on' arm's draft model, written or converted under ``tmp`` where needed:
    ``--draft-shape`` written as ``--shape`` writes one (``--shape-dtype``, ``--shape-tokenizer``),
    ``--draft-model self`` the target's own weights (a GGUF target converted first)."""
    if args.draft_shape:
        from stagemesh.bench.random_checkpoint import shape_config, write_random_checkpoint

        return str(write_random_checkpoint(shape_config(args.draft_shape), tmp / f"draft-{args.draft_shape}",
                                           args.shape_dtype, tokenizer_dir=args.shape_tokenizer))
    if args.draft_model != SELF:
        return args.draft_model
    if spec.format == "gguf":
        from stage_worker.checkpoint.convert import convert_gguf_to_mlx_dir

        return convert_gguf_to_mlx_dir(spec.path, str(tmp / "draft-self"))
    return str(spec.path)


def format_speculative(report: dict[str, Any]) -> str:
    """Each level's arms: tokens per second, on over off, identity and acceptance (pure)."""
    lines = [f"{'streams':>7} {'speculation':<12} {'tok/s':>8} {'tokens':>7} {'accepted':>9} "
             f"{'tokens/verification':>20}"]
    for level in report["results"]["levels"]:
        for arm in ("off", "on"):
            figures = level[arm]
            accepted = figures.get("acceptance_rate")
            per_trip = figures.get("tokens_per_verification")
            lines.append(f"{level['streams']:>7} {arm:<12} {figures['tokens_per_s']:>8g} {figures['tokens']:>7} "
                         f"{'-' if accepted is None else f'{100 * accepted:.0f}%':>9} "
                         f"{'-' if per_trip is None else f'{per_trip:.2f}':>20}")
    for ratio in report["ratios"]:
        lines.append(f"{ratio['streams']} stream(s): speculation on / off {ratio['tokens_per_s']:.3f}x output "
                     f"tokens/s; greedy tokens {'identical' if ratio['identical_greedy_tokens'] else 'DIFFERENT'}")
    lines += _breakdown_lines(report["results"]["levels"])
    return "\n".join(lines)


def _breakdown_lines(levels: list[dict[str, Any]]) -> list[str]:
    """Where each arm's step time went: the target's steps by kind, the draft's rounds by phase (pure)."""
    lines = []
    for level in levels:
        for arm in ("off", "on"):
            steps = level[arm].get("target_steps")
            if steps:
                lines.append(f"{level['streams']} stream(s), {arm}: target " + ", ".join(
                    f"{kind} {s['ms_per_step']:.1f} ms x {s['steps']} ({s['rows_per_step']:g} rows)"
                    for kind, s in steps.items()))
            draft = level[arm].get("draft")
            if draft:
                phases = ", ".join(f"{phase} {ms:.2f}" for phase, ms in draft["ms_per_round_by_phase"].items())
                lines.append(f"{level['streams']} stream(s), {arm}: draft {draft['ms_per_round']:.1f} ms per round "
                             f"x {draft['rounds']} ({draft['rows_per_round']:g} sequences, "
                             f"{draft['catch_up_forwards_per_round']:g} catch-up forwards of "
                             f"{draft['catch_up_tokens_per_round']:g} tokens): {phases} ms")
    return lines


def _drive(model: Any, prompts: list[tuple[int, ...]], stops: frozenset[int], output_len: int,
           speculative: Any, proposer: Any, streams: int) -> dict[str, Any]:
    """The prompts through a fresh engine, ``streams`` requests at once (at least every prompt once; request i
    asks prompt i mod their number; one stream: every prompt once, one after the other); tokens/s over the
    whole run (all tokens over all the time)."""
    from stage_worker.engine.entry_engine import EntryEngine, RequestFailed
    from stage_worker.engine.scheduler import GenerationRequest, Scheduler
    from stage_worker.engine.stage_runtime import StageCompute
    from stage_worker.engine.stage_status import StageStatus
    from stagemesh.bench.engine import drive_engine
    from stagemesh.bench.speculative_served import timed_streams

    longest = max(len(p) for p in prompts) + output_len + 1
    seats = max(4, streams)
    if proposer is not None:
        proposer.clear()
        proposer.take_timings()
    scheduler = Scheduler(max_num_seqs=seats, max_model_len=longest, max_waiting=seats, speculative=speculative,
                          proposer=proposer if speculative is not None else None)
    pipeline = _timed_pipeline(StageCompute(model, seats))
    engine = EntryEngine(pipeline, scheduler, StageStatus())
    requests = max(len(prompts), streams)
    outputs: list[list[int]] = [[] for _ in range(requests)]
    timing: dict[str, float] = {}
    failures: list[str] = []

    def stream(first: int) -> None:
        for index in range(first, requests, streams):
            handle = engine.submit(GenerationRequest(f"p{index}", prompts[index % len(prompts)], output_len,
                                                     stop_token_ids=stops))
            while True:
                event = handle.events.get(timeout=600)
                if isinstance(event, RequestFailed):
                    failures.append(event.message)
                    return
                outputs[index] += event.token_ids
                if event.finish is not None:
                    break

    def client() -> None:
        timing["seconds"] = timed_streams(streams, stream)

    drive_engine(engine, client)
    if failures:
        raise RuntimeError(f"request failed: {failures[0]}")
    if "seconds" not in timing:
        raise RuntimeError("the engine stopped before every prompt finished")
    tokens = sum(len(o) for o in outputs)
    counts = scheduler.spec_decode.counts
    result: dict[str, Any] = {"tokens": tokens, "seconds": round(timing["seconds"], 3),
                              "tokens_per_s": round(tokens / timing["seconds"], 1), "outputs": outputs}
    if counts.drafts:
        result["acceptance_rate"] = round(counts.acceptance_rate, 3)
        result["tokens_per_verification"] = round((counts.accepted_tokens + counts.drafts) / counts.drafts, 2)
        result["spec_decode"] = asdict(counts)
        # Steps that fed one token: every token is a prompt's first, one of a plain step, or a verification's.
        result["plain_decode_steps"] = tokens - requests - counts.accepted_tokens - counts.drafts
    result["target_steps"] = pipeline.steps.report()
    if proposer is not None and speculative is not None:
        result["draft"] = draft_report(proposer.take_timings())
    return result


def draft_report(timings: Any) -> dict[str, Any]:
    """A run's ``DraftTimings`` as milliseconds per proposal round, by phase (pure)."""
    rounds = max(1, timings.rounds)
    return {"rounds": timings.rounds, "rows_per_round": round(timings.rows / rounds, 2),
            "catch_up_forwards_per_round": round(timings.catch_up_forwards / rounds, 2),
            "catch_up_tokens_per_round": round(timings.catch_up_tokens / rounds, 2),
            "ms_per_round": round(1000 * timings.seconds / rounds, 3),
            "ms_per_round_by_phase": {phase: round(1000 * getattr(timings, f"{phase}_s") / rounds, 3)
                                      for phase in timings.PHASES}}


STEP_KINDS = ("verify", "plain", "prompt")


def step_kind(chunks: Any) -> str | None:
    """A batch's kind for the step breakdown (pure): ``verify`` when any sequence verifies proposals,
    ``prompt`` when it holds a prompt chunk, else ``plain`` (one token per decoding sequence); None when it
    feeds no token (only releases)."""
    from stage_worker.batch import RecordFlag

    records = [c.record for c in chunks if c.record.num_tokens]
    if not records:
        return None
    if any(r.has(RecordFlag.VERIFY) for r in records):
        return "verify"
    if any(r.has(RecordFlag.NEW_SEQUENCE) or r.num_tokens > 1 or not r.has(RecordFlag.SAMPLE) for r in records):
        return "prompt"
    return "plain"


class StepTimes:
    """Each kind of target step's count, rows and seconds (``step_kind``)."""

    def __init__(self) -> None:
        self.counts = dict.fromkeys(STEP_KINDS, 0)
        self.rows = dict.fromkeys(STEP_KINDS, 0)
        self.seconds = dict.fromkeys(STEP_KINDS, 0.0)

    def add(self, kind: str, rows: int, seconds: float) -> None:
        self.counts[kind] += 1
        self.rows[kind] += rows
        self.seconds[kind] += seconds

    def report(self) -> dict[str, dict[str, float]]:
        return {kind: {"steps": self.counts[kind], "rows_per_step": round(self.rows[kind] / self.counts[kind], 2),
                       "ms_per_step": round(1000 * self.seconds[kind] / self.counts[kind], 3)}
                for kind in STEP_KINDS if self.counts[kind]}


def _timed_pipeline(compute: Any) -> Any:
    """A single-stage ``EntryPipeline`` that times each batch from ``submit`` until ``collect`` returns its
    tokens (the bench's engine collects each batch before submitting the next: no steps ahead)."""
    from stage_worker.engine.stage_runtime import EntryPipeline

    class TimedPipeline(EntryPipeline):
        def __init__(self) -> None:
            super().__init__(compute, None, None, is_last=True)
            self.steps = StepTimes()
            self._submitted: list[tuple[str | None, int, float]] = []

        def submit(self, chunks: Any) -> int:
            rows = sum(c.record.num_tokens for c in chunks)
            self._submitted.append((step_kind(chunks), rows, time.perf_counter()))
            return super().submit(chunks)

        def collect(self) -> Any:
            sampled = super().collect()
            kind, rows, started = self._submitted.pop(0)
            if kind is not None:
                self.steps.add(kind, rows, time.perf_counter() - started)
            return sampled

    return TimedPipeline()


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median tokens/s (its own figures, so they stay consistent), and every run's tokens/s."""
    ordered = sorted(runs, key=lambda r: r["tokens_per_s"])
    return {**ordered[len(ordered) // 2], "tokens_per_s_runs": [r["tokens_per_s"] for r in runs]}
