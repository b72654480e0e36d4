"""The ``stagemesh`` command: one subcommand per job, each in its own module.

Each subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int``;
this file only wires them together, so ``stagemesh --help`` lists everything.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "parity": ("stagemesh.parity", "check that PP=N computes bit-identical logits and tokens to PP=1"),
    "bench-pipeline": ("stagemesh.pipeline_bench",
                       "measure per-stage memory and decode speed of PP=1..N against mlx_lm"),
    "convert": ("stagemesh.convert_cmd", "convert a GGUF model into an mlx-lm model directory"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stagemesh",
        description="Serve language models from a handful of Macs as a gRPC stage mesh over MLX's ring.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        sub_parser = sub.add_parser(name, help=help_text, description=module.__doc__,
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(sub_parser)
        sub_parser.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args._run(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
