"""The layer plan for the cluster this process sees, without starting a stage (``stagemesh plan``, ``serve --dry-run``).

- No ``RAY_ADDRESS``: a local mesh runs every stage on this machine, so the
  plan uses this machine's own facts (``StageHost.node_memory``, the same
  subprocess probe a node's StageHost runs) with all ``-pp`` x ``-dp`` stages
  sharing its memory. Ray is not started.
- ``RAY_ADDRESS``: join the cluster, place the stages as ``serve`` would
  (``placement.place_stages``), and ask one short-lived StageHost on each
  chosen node for its memory and backend (pinned to the node by node
  affinity, holding no ``mlx`` unit, so a mesh already serving there is not
  disturbed); then disconnect.

Either way the planner (``coordinator.layer_planner``) decides; a request that
cannot fit raises its ``PlanError``. ``preview`` adds each stage's device and whether
its tensor-parallel group shares one node (for ``stagemesh_core.tp_cost``).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from coordinator.config import MeshConfig
from coordinator.layer_planner import MemoryPlan, StageSeat, plan_mesh
from coordinator.placement import ClusterNode, Placement, place_stages
from coordinator.ray_cluster import RAY_ADDRESS_ENV, cluster_nodes, connect_ray, disconnect, head_address
from coordinator.stage_host import HostInfo, StageHost, node_probe_actor
from stagemesh_core.memory import NodeMemory
from stagemesh_core.settings import LOOPBACK

_PROBE_S = 120.0


@dataclass(frozen=True)
class PlanPreview:
    """The plan, and per planned stage (``[replica][rank]``) its node's device name and whether every
    worker of its tensor-parallel group runs on that one node."""

    plan: MemoryPlan
    devices: tuple[tuple[str, ...], ...]
    one_node: tuple[tuple[bool, ...], ...]


def preview_plan(config: MeshConfig) -> MemoryPlan:
    """The plan ``serve`` would make with ``config`` (which must carry ``model_facts``)."""
    return preview(config).plan


def preview(config: MeshConfig) -> PlanPreview:
    """``preview_plan``'s plan with each stage's device and group placement."""
    model = config.planned_facts()
    auto = config.auto_kv_facts()  # a quantized --kv-cache-dtype's plan states its context against auto's
    if model is None:
        raise ValueError("preview_plan needs the model's facts (MeshConfig.model_facts)")
    address = config.ray_address or os.environ.get(RAY_ADDRESS_ENV)
    pp, dp = config.pipeline_parallel_size, config.data_parallel_size
    if not address:
        memory = StageHost("plan").node_memory()
        sharing = config.total_workers
        seat = StageSeat("local", LOOPBACK, memory, sharing, socket.gethostname())
        replicas = [[seat] * pp for _ in range(dp)]
        return PlanPreview(plan_mesh(model, replicas, config.plan_request(), auto),
                           tuple((memory.device,) * pp for _ in range(dp)), tuple((True,) * pp for _ in range(dp)))
    session = connect_ray(config.total_workers, address=address)
    try:
        nodes = cluster_nodes(session.driver_node_id)
        placement = place_stages(nodes, pp, dp, head_address=head_address(nodes),
                                 tensor_parallel_size=config.tensor_parallel_size)
        facts = _ask_nodes(sorted({s.node_id for s in placement.slots}))
        return _placed_preview(config, placement, {n: memory for n, (_, memory) in facts.items()},
                               {n: (info.host, info.hostname) for n, (info, _) in facts.items()})
    finally:
        disconnect(session)


def assumed_preview(config: MeshConfig, nodes: Sequence[tuple[str, NodeMemory]]) -> PlanPreview:
    """``preview`` for nodes described instead of asked (``stagemesh plan --assume-node``, the first the head):
    serve's own placement over them, the workers shared out evenly (each node offering as many ``mlx`` units
    as that takes: one each where there are as many nodes as workers), and the same seats: each stage
    planned where its worker 0 runs, with a worker's share of the model, beside every worker on that node."""
    units = -(-config.total_workers // max(1, len(nodes)))
    cluster = [ClusterNode(name, name, units, is_head=i == 0) for i, (name, _) in enumerate(nodes)]
    placement = place_stages(cluster, config.pipeline_parallel_size, config.data_parallel_size,
                             tensor_parallel_size=config.tensor_parallel_size)
    return _placed_preview(config, placement, dict(nodes), {name: (name, name) for name, _ in nodes})


def _placed_preview(config: MeshConfig, placement: Placement, memory: Mapping[str, NodeMemory],
                    names: Mapping[str, tuple[str, str]]) -> PlanPreview:
    """The plan over ``placement``'s nodes (``memory`` and ``(host, hostname)`` by node id), with each stage's
    device and whether its group is on one node."""
    model, auto = config.planned_facts(), config.auto_kv_facts()
    if model is None:
        raise ValueError("a plan preview needs the model's facts (MeshConfig.model_facts)")
    per_node: dict[str, int] = {}
    for slot in placement.slots:
        per_node[slot.node_id] = per_node.get(slot.node_id, 0) + 1
    # Each stage is planned where its worker 0 runs (with a worker's share of the model).
    seats = [[StageSeat(s.node_id, names[s.node_id][0], memory[s.node_id], per_node[s.node_id],
                        names[s.node_id][1]) for s in replica if s.member == 0]
             for replica in placement.replicas]
    groups = [[{s.node_id for s in replica if s.rank == rank} for rank in range(config.pipeline_parallel_size)]
              for replica in placement.replicas]
    return PlanPreview(plan_mesh(model, seats, config.plan_request(), auto),
                       tuple(tuple(seat.memory.device for seat in replica) for replica in seats),
                       tuple(tuple(len(g) == 1 for g in replica) for replica in groups))


def _ask_nodes(node_ids: list[str]) -> dict[str, tuple[HostInfo, NodeMemory]]:
    """(host info, memory) from a StageHost on each node; the actors are gone afterwards."""
    import ray

    actors = [node_probe_actor(node_id, f"plan-{node_id[:8]}") for node_id in node_ids]
    try:
        infos = ray.get([a.describe.remote() for a in actors], timeout=_PROBE_S)
        memories = ray.get([a.node_memory.remote() for a in actors], timeout=_PROBE_S)
    finally:
        for actor in actors:
            ray.kill(actor)
    return {node_id: (info, memory) for node_id, info, memory in zip(node_ids, infos, memories)}
