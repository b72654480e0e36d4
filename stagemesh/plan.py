"""``stagemesh plan [MODEL]``: the layer plan ``serve`` would use on the cluster it sees; starts no stage.

Takes ``serve``'s flags (model, ``-pp``, ``-dp``, ``--max-model-len``,
``--max-num-seqs``, ``--memory-fraction``, ``--dtype``, ``--dequantize``,
``--pp-layer-split``) and prints one row per stage: node, address, backend and
dtype, layers, weight GB, KV GB (the tokens it holds) and headroom; ``--json``
prints the same for tools. The cluster is this machine (no ``RAY_ADDRESS``) or
the Ray cluster at ``RAY_ADDRESS``, each node's facts read on that node
(``coordinator.plan_preview``), or the nodes ``--assume-node`` describes (to
ask "what if I add a 24 GB Mac mini?"). A request that cannot fit exits 2 with
the numbers and the ways out; ``stagemesh serve --dry-run`` does the same.
"""

from __future__ import annotations

import argparse
import json
import sys

from stagemesh import serve


def add_arguments(parser: argparse.ArgumentParser) -> None:
    serve.add_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--assume-node", action="append", default=[], metavar="NAME=SIZE[:BACKEND]",
                        help="plan for a cluster you describe instead of the one this machine sees: a node NAME "
                             "whose stages may count SIZE (e.g. 96GB; on a Mac its GPU's recommended working set), "
                             "BACKEND metal (default), cpu or cuda; repeat per node. Stage g of the mesh runs on "
                             "node g mod the number of nodes")


def assumed_seats(specs: list[str], pp: int, dp: int) -> list[list]:
    """Seats for ``--assume-node`` values (what-if planning: nothing is asked of any node)."""
    from coordinator.layer_planner import StageSeat
    from stagemesh.core.errors import UserError
    from stagemesh.core.memory import NodeMemory
    from stagemesh.core.settings import parse_size

    nodes = []
    for spec in specs:
        name, _, rest = spec.partition("=")
        size, _, backend = rest.partition(":")
        backend = backend or "metal"
        try:
            total = parse_size(size)
        except ValueError as exc:
            raise UserError(f"--assume-node {spec!r}: {exc}") from None
        if not name or backend not in ("metal", "cpu", "cuda"):
            raise UserError(f"--assume-node {spec!r}: write NAME=SIZE[:BACKEND], e.g. mac-mini=16GB:metal")
        device = None if backend == "cpu" else total
        nodes.append((name, NodeMemory(backend, "assumed", total, total, device, device)))
    total_stages = pp * dp
    sharing = [sum(1 for g in range(total_stages) if g % len(nodes) == i) for i in range(len(nodes))]
    return [[StageSeat(nodes[g % len(nodes)][0], nodes[g % len(nodes)][0], nodes[g % len(nodes)][1],
                       sharing[g % len(nodes)], nodes[g % len(nodes)][0])
             for g in range(replica * pp, (replica + 1) * pp)] for replica in range(dp)]


def print_plan(config, as_json: bool, assume: list[str] | None = None) -> int:
    """Plan ``config`` (a ``MeshConfig`` with the model's facts) for the cluster it sees, or for the nodes
    ``assume`` describes, and print it; the command's exit code."""
    from coordinator.layer_planner import format_plan, plan_mesh
    from coordinator.placement import PlacementError
    from coordinator.plan_preview import preview_plan
    from coordinator.ray_cluster import RayStartError

    try:
        if assume:
            seats = assumed_seats(assume, config.pipeline_parallel_size, config.data_parallel_size)
            plan = plan_mesh(config.model_facts, seats, config.plan_request())
        else:
            plan = preview_plan(config)
    except (PlacementError, RayStartError) as exc:
        print(f"stagemesh plan: error: {exc}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps({"model": config.served_model_name, "num_layers": config.num_layers, **plan.to_json()},
                         indent=2))
    else:
        print(f"model: {config.served_model_name} ({config.num_layers} layers), -pp {config.pipeline_parallel_size} "
              f"-dp {config.data_parallel_size}, --max-model-len {config.max_model_len}")
        print(format_plan(plan))
    return 0


def run(args: argparse.Namespace) -> int:
    _, config = serve.build_mesh_config(args)
    return print_plan(config, args.json, args.assume_node)
