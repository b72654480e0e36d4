"""The flags the kinds of ``stagemesh bench`` share, each defined once.

Contract: ``add_report_flags`` gives every kind ``--output FILE`` (the JSON
report, ``stagemesh.bench.report``) and ``--json`` (that report on stdout
instead of the text); ``stagemesh.bench.command`` adds them to every kind.
The other ``add_*`` functions are for the kinds whose flag means the same
thing (prompt and output lengths, load levels, warm-up and rounds, seed, the
model, a random-weight shape, ports, extra ``serve`` flags); a kind passes
only its own default and, where it helps, a note on its unit. ``HELP`` holds
each shared flag's text, so a flag reads the same in every kind's ``--help``.
Nothing here parses values or runs anything.
"""

from __future__ import annotations

import argparse

from stagemesh.bench.random_checkpoint import SHAPE_QUANTIZATIONS

# A parser or one of its argument groups (both add arguments; argparse names their common base privately).
Flags = argparse._ActionsContainer

HELP: dict[str, str] = {
    "--output": "write the report (JSON: kind, command, environment, config, results, ratios) to FILE",
    "--json": "print the report as JSON on stdout instead of the text (progress stays on stderr)",
    "model": "a model stagemesh serve reads: GGUF file or model directory (default: the embedded default model)",
    "--shape": "a real-sized model with random weights instead of MODEL: a shipped shape (llama-3.2-1b, "
               "llama-3.1-8b, qwen3-8b, qwen3-30b-a3b, gpt-oss-20b, ...; stagemesh serve --help lists them all)",
    "--shape-layers": "only the --shape model's first N decoder layers (its layer pattern kept: dense first layers, "
                      "sliding and full attention), to run part of a model too big for the machine",
    "--shape-dtype": "dtype of the --shape checkpoint",
    "--shape-quantization": "quantize the --shape checkpoint with mlx-lm's own code, as mlx_lm.convert -q would: "
                            "affine2-affine8 (groups of 64), mxfp4, nvfp4, mxfp8, or a mixed recipe (mixed_2_6, "
                            "mixed_3_4, mixed_3_6, mixed_4_6); stagemesh serve's --dequantize auto may still run it "
                            "dense (CUDA, CPU), --serve-args '--dequantize off' keeps it quantized",
    "--shape-tokenizer": "Hugging Face tokenizer directory for the --shape checkpoint (default: the embedded model's)",
    "--dtype": "compute dtype: auto (the backend's), float32, float16, bfloat16",
    "--input-len": "prompt tokens per request",
    "--output-len": "tokens generated per request",
    "--concurrency": "load levels, comma-separated: requests kept in flight",
    "--num-prompts": "requests per level (and endpoint, and round)",
    "--warmup": "uncounted runs first, so the measured ones start warm",
    "--rounds": "repeat every measurement this many times, arms alternating, so machine noise hits all alike",
    "--seed": "seed of everything random in the workload (prompts, lengths, arrivals)",
    "--tokenizer": "GGUF file or tokenizer directory to size prompts in tokens",
    "--port-base": "first of the loopback ports this benchmark's own processes listen on",
    "--serve-args": "extra flags for every stagemesh serve this benchmark starts, space-separated",
}


def _help(flag: str, default: object = None, note: str = "") -> str:
    text = HELP[flag] + (f"; {note}" if note else "")
    return text + (" (default %(default)s)" if default is not None else "")


def add_report_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("report (every kind)")
    group.add_argument("--output", default=None, metavar="FILE", help=_help("--output"))
    group.add_argument("--json", action="store_true", help=_help("--json"))


def add_model_argument(parser: Flags, note: str = "") -> None:
    parser.add_argument("model", nargs="?", default=None, metavar="MODEL", help=_help("model", note=note))


def add_shape_flags(parser: Flags) -> None:
    parser.add_argument("--shape", default=None, metavar="NAME", help=_help("--shape"))
    parser.add_argument("--shape-layers", type=int, default=None, metavar="N", help=_help("--shape-layers"))
    parser.add_argument("--shape-dtype", default="bfloat16", help=_help("--shape-dtype", "bfloat16"))
    parser.add_argument("--shape-tokenizer", default=None, metavar="DIR", help=_help("--shape-tokenizer"))
    parser.add_argument("--shape-quantization", default=None, choices=list(SHAPE_QUANTIZATIONS), metavar="NAME",
                        help=_help("--shape-quantization"))


def add_dtype(parser: Flags) -> None:
    parser.add_argument("--dtype", default="auto", help=_help("--dtype", "auto"))


def add_lengths(parser: Flags, *, input_len: int | None, output_len: int | None,
                input_note: str = "", output_note: str = "", with_input: bool = True) -> None:
    """``--input-len`` and ``--output-len``; a default of None leaves the choice to the kind (its note says)."""
    if with_input:
        parser.add_argument("--input-len", type=int, default=input_len, metavar="N",
                            help=_help("--input-len", input_len, input_note))
    parser.add_argument("--output-len", type=int, default=output_len, metavar="N",
                        help=_help("--output-len", output_len, output_note))


def add_concurrency(parser: Flags, default: str | None, note: str = "") -> None:
    parser.add_argument("--concurrency", default=default, metavar="N,N,...", help=_help("--concurrency", default, note))


def add_num_prompts(parser: Flags, default: int | None, note: str = "") -> None:
    parser.add_argument("--num-prompts", type=int, default=default, metavar="N",
                        help=_help("--num-prompts", default, note))


def add_warmup(parser: Flags, default: int, unit: str) -> None:
    parser.add_argument("--warmup", type=int, default=default, metavar="N", help=_help("--warmup", default, unit))


def add_rounds(parser: Flags, default: int) -> None:
    parser.add_argument("--rounds", type=int, default=default, metavar="N", help=_help("--rounds", default))


def add_seed(parser: Flags) -> None:
    parser.add_argument("--seed", type=int, default=0, help=_help("--seed", 0))


def add_tokenizer(parser: Flags, note: str) -> None:
    parser.add_argument("--tokenizer", default=None, metavar="PATH", help=_help("--tokenizer", note=note))


def add_port_base(parser: Flags, default: int, note: str) -> None:
    parser.add_argument("--port-base", type=int, default=default, metavar="PORT",
                        help=_help("--port-base", default, note))


def add_serve_args(parser: Flags) -> None:
    parser.add_argument("--serve-args", default="", metavar="FLAGS", help=_help("--serve-args"))
