"""The layer plan as ``stagemesh plan`` and ``stagemesh serve --dry-run`` print it.

Contract: ``print_plan(config, as_json, assume)`` plans a ``MeshConfig`` for the cluster this machine sees
(``coordinator.plan_preview``: each node's facts read on that node) or for the nodes ``--assume-node``
describes (``assumed_seats``), prints one row per stage (or the JSON) and returns the exit code: 2 when the
plan cannot fit, with the numbers and the ways out. It starts no stage.
"""

from __future__ import annotations

import json
import sys

from coordinator.layer_planner import StageSeat, format_plan, plan_mesh
from coordinator.placement import PlacementError
from coordinator.plan_preview import preview_plan
from coordinator.ray_cluster import RayStartError
from stagemesh_core.errors import UserError
from stagemesh_core.memory import NodeMemory
from stagemesh_core.settings import parse_size


def assumed_seats(specs: list[str], pp: int, dp: int) -> list[list]:
    """Seats for ``--assume-node`` values (what-if planning: nothing is asked of any node)."""
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
        tp = config.tensor_parallel_size
        groups = (f" -tp {tp} (each row is a stage's worker 0: every worker holds 1/{tp} of each layer's weights and "
                  "KV, worker 0 also the embedding and head)") if tp > 1 else ""
        print(f"model: {config.served_model_name} ({config.num_layers} layers), -pp {config.pipeline_parallel_size} "
              f"-dp {config.data_parallel_size}{groups}, --max-model-len {config.max_model_len}")
        print(format_plan(plan))
    return 0
