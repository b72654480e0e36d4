"""``stagemesh plan [MODEL]``: the layer plan ``serve`` would use on the cluster it sees; starts no stage.

Takes ``serve``'s flags (model, ``-pp``, ``-dp``, ``--max-model-len``,
``--max-num-seqs``, ``--memory-fraction``, ``--dtype``, ``--dequantize``,
``--pp-layer-split``) and prints one row per stage: node, address, backend and
dtype, layers, weight GB, KV GB (the tokens it holds) and headroom; ``--json``
prints the same for tools. The cluster is this machine (no ``RAY_ADDRESS``) or
the Ray cluster at ``RAY_ADDRESS``, each node's facts read on that node
(``coordinator.plan_preview``). A request that cannot fit exits 2 with the
numbers and the ways out; ``stagemesh serve --dry-run`` does the same.
"""

from __future__ import annotations

import argparse
import json
import sys

from stagemesh import serve


def add_arguments(parser: argparse.ArgumentParser) -> None:
    serve.add_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def print_plan(config, as_json: bool) -> int:
    """Plan ``config`` (a ``MeshConfig`` with the model's facts) and print it; the command's exit code."""
    from coordinator.layer_planner import format_plan
    from coordinator.placement import PlacementError
    from coordinator.plan_preview import preview_plan
    from coordinator.ray_cluster import RayStartError

    try:
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
    return print_plan(config, args.json)
