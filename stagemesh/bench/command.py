"""``stagemesh bench KIND``: every benchmark of stagemesh, one subcommand per kind.

``KINDS`` lists them, from a whole server down to one part of it, each in the
module named after it (``stagemesh.bench.KIND``). Every kind prints a text
summary on stdout (progress on stderr) and takes ``--output FILE`` (the JSON
report) and ``--json`` (that report on stdout); every report has the same
envelope (``stagemesh.bench.report``). Flags that mean the same in several
kinds are defined once (``stagemesh.bench.flags``). ``stagemesh bench KIND
--help`` lists a kind's flags.
"""

from __future__ import annotations

import argparse
import importlib

# kind -> (module, one-line help), in the order --help lists them; each module exposes
# add_arguments(parser) and run(args) -> int.
KINDS: dict[str, tuple[str, str]] = {
    "serve": ("stagemesh.bench.serve",
              "load-test OpenAI-compatible endpoints: TTFT, inter-token latency, throughput"),
    "compare": ("stagemesh.bench.compare",
                "serve the standing configurations (vs mlx_lm.server, PP=2 vs PP=1, two hosts...) and "
                "compare them side by side"),
    "stack": ("stagemesh.bench.stack",
              "the same load at the engine, the entry stage's gRPC and the gateway: what each layer costs"),
    "gateway": ("stagemesh.bench.gateway",
                "the gateway alone, fed tokens at a GPU mesh's rate: its CPU per token, where it caps"),
    "engine": ("stagemesh.bench.engine",
               "time the entry stage alone (engine, scheduler, model): ms per token, streams, profile"),
    "prefix": ("stagemesh.bench.prefix",
               "what the prefix cache is worth: multi-turn chat and distinct prompts, cache off against on"),
    "speculative": ("stagemesh.bench.speculative",
                    "what speculative decoding is worth (prompt lookup or a draft model): repeat/edit-this-code "
                    "prompts, off vs on, one stage or --pp N servers"),
    "pipeline": ("stagemesh.bench.pipeline",
                 "measure per-stage memory and decode speed of PP=1..N against mlx_lm"),
    "experts": ("stagemesh.bench.experts",
                "one mixture-of-experts block: mlx-lm's gathered experts against every expert, by rows per call"),
    "tensor": ("stagemesh.bench.tensor",
               "one stage's decode as a tensor-parallel group against one process, and this machine's ceiling"),
    "hop": ("stagemesh.bench.hop", "time one pipeline hop's parts (ring, TCP lane, device sync, copies)"),
    "parity": ("stagemesh.bench.parity", "check that PP=N computes bit-identical logits and tokens to PP=1"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from stagemesh.bench import flags

    # Every kind's module imports only the standard library and light stagemesh modules at the top (no
    # third-party package: no grpc, MLX or httpx), so building all of them is cheap.
    kinds = parser.add_subparsers(dest="kind", metavar="KIND", title="kinds")
    for kind, (module_name, help_text) in KINDS.items():
        module = importlib.import_module(module_name)
        kind_parser = kinds.add_parser(kind, help=help_text, description=module.__doc__,
                                       formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(kind_parser)
        flags.add_report_flags(kind_parser)
        kind_parser.set_defaults(_run_kind=module.run, _command_name=f"bench {kind}")
    parser.set_defaults(_print_kinds=parser.print_help)


def run(args: argparse.Namespace) -> int:
    if args.kind is None:  # ``stagemesh bench`` alone: say which kinds there are
        args._print_kinds()
        return 0
    result: int = args._run_kind(args)
    return result
