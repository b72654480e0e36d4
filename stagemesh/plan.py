"""``stagemesh plan [MODEL]``: the layer plan ``serve`` would use on the cluster it sees; starts no stage.

Takes ``serve``'s flags (model, ``-pp``, ``-dp``, ``--max-model-len``,
``--max-num-seqs``, ``--memory-fraction``, ``--dtype``, ``--dequantize``,
``--kv-cache-dtype``, ``--pp-layer-split``) and prints one row per stage: node, address, backend and
dtype, layers, weight GB, KV GB (the tokens it holds) and headroom, then the KV dtype beside its tokens
(q8 / q4: and how many times auto's on the same stages); at ``-tp``
above 1 the all-reduce cost per token and -tp against -pp over the link
(``--tp-link FILE`` from ``stagemesh doctor --tp-link``, or
``--tp-link-latency-us``); ``--json`` prints the same for tools. The cluster is this machine (no ``RAY_ADDRESS``) or
the Ray cluster at ``RAY_ADDRESS``, each node's facts read on that node
(``coordinator.plan_preview``), or the nodes ``--assume-node`` describes (to
ask "what if I add a 24 GB Mac mini?"). A request that cannot fit exits 2 with
the numbers and the ways out; ``stagemesh serve --dry-run`` does the same.
"""

from __future__ import annotations

import argparse
import sys

from stagemesh import serve
from stagemesh.plan_report import print_plan, tp_link_for
from stagemesh_core.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    serve.add_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--assume-node", action="append", default=[], metavar="NAME=SIZE[:BACKEND]",
                        help="plan for a cluster you describe instead of the one this machine sees: a node NAME "
                             "whose stages may count SIZE (e.g. 96GB; on a Mac its GPU's recommended working set), "
                             "BACKEND metal (default), cpu or cuda; repeat per node. Stage g of the mesh runs on "
                             "node g mod the number of nodes")


def run(args: argparse.Namespace) -> int:
    spec, config = serve.build_mesh_config(args)
    try:
        link = tp_link_for(args, config.tensor_parallel_size, config.tp_backend)
    except UserError as exc:
        print(f"stagemesh plan: error: {exc}", file=sys.stderr)
        return 2
    return print_plan(config, args.json, args.assume_node, link=link, spec=spec)
