"""``stagemesh bench speculative``: what prompt-lookup speculation is worth, speculation off against on.

Loads MODEL (default: the embedded model) as one stage, as ``stagemesh bench prefix`` does (no gRPC, no
gateway; the optimized BLAS preloaded and dense weights where a stage would choose them), and runs one
workload twice in one invocation, without and with ``--speculative-config``: chat prompts that ask the model
to repeat or edit a piece of code it is given (what prompt lookup is for), one request at a time (one
stream), greedy, each until the model's end-of-sequence token or ``--output-len`` tokens. Every prompt runs
``--rounds`` times per arm, the arms alternating so machine noise hits both alike.

It reports output tokens per second of each arm (all tokens over all the time, medians over rounds), the on /
off ratio, whether the two arms' greedy tokens are identical (they must be), and the share of proposed
tokens the model accepted.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict
from typing import Any

from stagemesh.bench import flags
from stagemesh.core.errors import UserError

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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    flags.add_model_argument(parser)
    parser.add_argument("--speculative-config", default=DEFAULT_CONFIG, metavar="JSON",
                        help="the speculation of the 'on' arm, as stagemesh serve takes it (default %(default)s)")
    flags.add_lengths(parser, input_len=None, output_len=256, with_input=False, output_note="at most, per prompt")
    flags.add_rounds(parser, 3)


def run(args: argparse.Namespace) -> int:
    from stagemesh.core.speculative import parse_speculative_config

    if args.output_len < 1 or args.rounds < 1:
        raise UserError("--output-len and --rounds must be positive")
    config = parse_speculative_config(args.speculative_config)
    from stage_worker.blas import reexec_with_optimized_blas

    # As a stage does (stage_worker.process_setup): MLX's CPU kernels with the optimized BLAS, if any.
    reexec_with_optimized_blas(["-m", "stagemesh.cli", *sys.argv[1:]], None)
    from stage_worker.blas import loaded_blas
    from stage_worker.default_model import resolve_model_path
    from stage_worker.mlx_arch import exact_prefix_reuse
    from stage_worker.model_reader import read_model_spec
    from stage_worker.tokenizer import eos_token_ids, load_tokenizer
    from stagemesh.bench.prefix import load_stage_as_served
    from stagemesh.bench.report import build_report, emit, flags_of, now

    started_at = now()
    spec = read_model_spec(resolve_model_path(args.model))
    if not exact_prefix_reuse(spec):
        raise UserError(f"{spec.model_type} keeps sliding windows or recurrent state: it does not speculate")
    model, dense = load_stage_as_served(spec)
    tokenizer = load_tokenizer(spec)
    stops = eos_token_ids(spec, tokenizer)
    # As the gateway does (gateway.chat_template): the template's text, then its tokens.
    prompts = [tuple(tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                                    add_generation_prompt=True, tokenize=False),
                                      add_special_tokens=False)) for text in PROMPTS]
    _drive(model, prompts[:1], stops, 16, None)  # warm the kernels
    arms: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    outputs: dict[str, list[list[int]]] = {}
    for _ in range(args.rounds):
        for arm, speculative in (("off", None), ("on", config)):
            result = _drive(model, prompts, stops, args.output_len, speculative)
            outputs[arm] = result.pop("outputs")
            arms[arm].append(result)
    results = {arm: _median(runs) for arm, runs in arms.items()}
    identical = outputs["off"] == outputs["on"]
    ratio = round(results["on"]["tokens_per_s"] / results["off"]["tokens_per_s"], 3)
    report = build_report("speculative", started_at=started_at, local_mlx=True, results=results,
                          ratios=[{"compares": "speculation on / off", "tokens_per_s": ratio,
                                   "identical_greedy_tokens": identical}],
                          config={**flags_of(args), "model": spec.default_served_name, "blas": loaded_blas(),
                                  "dense_weights": dense, "prompts": PROMPTS})
    emit(report, args, format_speculative(report))
    return 0 if identical else 1


def format_speculative(report: dict[str, Any]) -> str:
    """Each arm's tokens per second, on over off, identity and acceptance (pure)."""
    lines = [f"{'speculation':<12} {'tok/s':>8} {'tokens':>7} {'accepted':>9} {'tokens/verification':>20}"]
    for arm, figures in report["results"].items():
        accepted = figures.get("acceptance_rate")
        per_trip = figures.get("tokens_per_verification")
        lines.append(f"{arm:<12} {figures['tokens_per_s']:>8g} {figures['tokens']:>7} "
                     f"{'-' if accepted is None else f'{100 * accepted:.0f}%':>9} "
                     f"{'-' if per_trip is None else f'{per_trip:.2f}':>20}")
    (ratio,) = report["ratios"]
    lines.append(f"speculation on / off: {ratio['tokens_per_s']:.3f}x output tokens/s; greedy tokens "
                 f"{'identical' if ratio['identical_greedy_tokens'] else 'DIFFERENT'}")
    return "\n".join(lines)


def _drive(model: Any, prompts: list[tuple[int, ...]], stops: frozenset[int], output_len: int,
           speculative: Any) -> dict[str, Any]:
    """Every prompt in turn through a fresh engine (one stream); tokens/s over the whole run."""
    from stage_worker.engine import EntryEngine, RequestFailed
    from stage_worker.scheduler import GenerationRequest, Scheduler
    from stage_worker.stage_runtime import EntryPipeline, StageCompute
    from stage_worker.stage_status import StageStatus
    from stagemesh.bench.engine import drive_engine

    longest = max(len(p) for p in prompts) + output_len + 1
    scheduler = Scheduler(max_num_seqs=4, max_model_len=longest, max_waiting=8, speculative=speculative)
    engine = EntryEngine(EntryPipeline(StageCompute(model, 4), None, None, is_last=True), scheduler, StageStatus())
    outputs: list[list[int]] = []
    timing: dict[str, float] = {}

    def client() -> None:
        started = time.perf_counter()
        for index, prompt in enumerate(prompts):
            handle = engine.submit(GenerationRequest(f"p{index}", prompt, output_len, stop_token_ids=stops))
            reply: list[int] = []
            while True:
                event = handle.events.get(timeout=600)
                if isinstance(event, RequestFailed):
                    raise RuntimeError(f"request failed: {event.message}")
                reply += event.token_ids
                if event.finish is not None:
                    break
            outputs.append(reply)
        timing["seconds"] = time.perf_counter() - started

    drive_engine(engine, client)
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
        result["plain_decode_steps"] = tokens - len(prompts) - counts.accepted_tokens - counts.drafts
    return result


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median tokens/s (its own figures, so they stay consistent), and every run's tokens/s."""
    ordered = sorted(runs, key=lambda r: r["tokens_per_s"])
    return {**ordered[len(ordered) // 2], "tokens_per_s_runs": [r["tokens_per_s"] for r in runs]}
