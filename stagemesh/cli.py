"""The ``stagemesh`` command: one subcommand per job, each in its own module.

Each subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int``;
this file only wires them together, so ``stagemesh --help`` lists everything.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from stagemesh.bench.command import KINDS as BENCH_KINDS  # names only: that module imports no benchmark

# subcommand -> (module, one-line help), in the order ``stagemesh --help`` lists them: the product's
# commands first, then the benchmarks (``stagemesh bench KIND``).
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("stagemesh.serve", "serve a model over the OpenAI API from a mesh of pipeline stages"),
    "chat": ("stagemesh.chat", "chat interactively with a running gateway"),
    "status": ("stagemesh.status", "show the mesh (replicas, stages, hosts, layers, ports, health)"),
    "plan": ("stagemesh.plan", "show the layer plan serve would use on this cluster (memory, KV), starting nothing"),
    "doctor": ("stagemesh.doctor.command", "check this node or the cluster for known pitfalls and say how to fix each"),
    "convert": ("stagemesh.convert_cmd", "convert a GGUF model into an mlx-lm model directory"),
    "certs": ("stagemesh.certs", "make a mesh CA and each node's certificate for --grpc-tls-dir (mutual TLS)"),
    "soak": ("stagemesh.soak.command", "hold N streaming clients against a mesh while injecting faults; judge it"),
    "bench": ("stagemesh.bench.command", f"benchmarks: stagemesh bench KIND ({', '.join(BENCH_KINDS)})"),
}


def _selected(argv: list[str]) -> str | None:
    """The subcommand named on the command line, so only its module is imported."""
    for arg in argv:
        if not arg.startswith("-"):
            return arg if arg in SUBCOMMANDS else None
    return None


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stagemesh",
        description="Serve language models from a handful of Macs as a gRPC stage mesh over MLX's ring.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = _selected(argv)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text,
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
        if name == chosen:
            # Heavy imports (MLX, transformers) happen only for the command being run.
            module = importlib.import_module(module_name)
            sub_parser.description = module.__doc__
            module.add_arguments(sub_parser)
            sub_parser.set_defaults(_run=module.run)
    return parser


# Commands whose process uses mlx-lm's model modules but never its package front door (``mlx_lm.load``,
# ``mlx_lm.generate``): as a stage does, they skip the tokenizer stack mlx-lm's ``__init__`` imports
# (``stage_worker.model.lean_mlx_lm``), which is most of a failed flag check's second.
LEAN_MLX_LM_COMMANDS = frozenset({"serve", "plan"})


def entry() -> int:
    """The ``stagemesh`` program: ``main`` in a process of its own, which it may set up for the command."""
    argv = sys.argv[1:]
    if _selected(argv) in LEAN_MLX_LM_COMMANDS:
        from stage_worker.model import lean_mlx_lm

        lean_mlx_lm.install()
    return main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    from stagemesh_core.errors import UserError

    try:
        return args._run(args)
    except UserError as exc:
        print(f"stagemesh {getattr(args, '_command_name', args.command)}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(entry())
