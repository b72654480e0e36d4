"""Placement: which Ray node hosts each (replica, rank), and the plans that follow.

Pure functions over plain values (no Ray), so every decision is unit-tested with made-up clusters:

- ``place_stages(nodes, P, D, T)`` gives each of the ``P * D * T`` workers (``T`` per stage with tensor
  parallelism) one ``mlx`` unit of a node; too few units raise ``PlacementError`` saying how many there are
  and how to add some.
- ``assign_gpus(nodes, gpu_counts, held)`` gives each stage one GPU of its node.
- ``pipeline_plan(replica, hosts, ...)`` builds one replica's ``PipelinePlan``: global stage index
  ``g = replica * P + rank`` fixes its ports (``stagemesh_core.ports``), ``hosts[rank * T + member]`` is the
  address that worker's node advertises.
- ``without_lost_nodes`` and ``check_port_ranges`` serve placing again and the port flags.
"""
from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from stagemesh_core.layer_split import LayerRange, plan_layer_split
from stagemesh_core.plan import PipelinePlan, StagePlacement, with_groups
from stagemesh_core.ports import PortRangeError, check_port_base, data_plane_ports, stage_ports
from stagemesh_core.settings import MLX_RESOURCE


class PlacementError(RuntimeError):
    """The cluster cannot host the requested mesh; the message says what to change."""


@dataclass(frozen=True)
class ClusterNode:
    """One Ray node as placement sees it."""

    node_id: str
    address: str  # the address Ray knows the node by (NodeManagerAddress)
    mlx_units: int
    is_head: bool = False  # the node the coordinator (and gateway) run on


@dataclass(frozen=True)
class StageSlot:
    """The node chosen for one stage's worker (the stage itself at -tp 1)."""

    replica: int
    rank: int
    node_id: str
    address: str
    member: int = 0  # its place in the stage's tensor-parallel group


@dataclass(frozen=True)
class Placement:
    pipeline_parallel_size: int
    data_parallel_size: int
    replicas: tuple[tuple[StageSlot, ...], ...]  # [replica][rank * T + member]
    tensor_parallel_size: int = 1

    @property
    def slots(self) -> tuple[StageSlot, ...]:
        """Every slot, replica-major: index ``(replica * P + rank) * T + member`` (at -tp 1 the global stage
        index)."""
        return tuple(s for replica in self.replicas for s in replica)

    def is_spread(self, replica: int) -> bool:
        """True when no two ranks of ``replica`` share a node."""
        nodes = [s.node_id for s in self.replicas[replica]]
        return len(set(nodes)) == len(nodes)


def _check_sizes(pipeline_parallel_size: int, data_parallel_size: int) -> None:
    if pipeline_parallel_size < 1:
        raise PlacementError(
            f"--pipeline-parallel-size/-pp must be at least 1, got {pipeline_parallel_size}."
        )
    if data_parallel_size < 1:
        raise PlacementError(
            f"--data-parallel-size/-dp must be at least 1, got {data_parallel_size}."
        )


def _not_enough_units(
    nodes: Sequence[ClusterNode], needed: int, pp: int, dp: int, local: bool, head_address: str | None, tp: int = 1,
) -> PlacementError:
    have = sum(max(0, n.mlx_units) for n in nodes)
    holders = [n for n in nodes if n.mlx_units > 0]
    where = ", ".join(f"{n.address} x{n.mlx_units}" for n in holders) or "no node has any"
    sizes = f"--pipeline-parallel-size {pp} x --data-parallel-size {dp}"
    if tp > 1:
        sizes += f" x --tensor-parallel-size {tp}"
    ask = f"{sizes} needs {needed} '{MLX_RESOURCE}' units (one per {'worker' if tp > 1 else 'stage'})"
    if tp > 1 and local:
        return PlacementError(
            f"{ask}, but this machine offers {have}: keep -pp x -dp x -tp at or below {have} (-tp {max(1, have)} "
            f"or less at -pp 1 -dp 1), or join a cluster with more Macs by setting RAY_ADDRESS.")
    if local:
        return PlacementError(
            f"{ask}, but this machine offers {have}. A local mesh (no RAY_ADDRESS) runs "
            f"every stage here: keep --pipeline-parallel-size x --data-parallel-size "
            f"at or below {have}, or join a cluster with more Macs by setting RAY_ADDRESS."
        )
    head = head_address or "HEAD_IP"
    return PlacementError(
        f"{ask}, but the Ray cluster has {have} ({where}). Add a Mac: on it run "
        f"`ray start --address={head}:6379 --resources='{{\"{MLX_RESOURCE}\": 1}}'` "
        f"(with STAGEMESH_HOST_IP set to the address its peers should use), or lower "
        + (f"-pp/-dp/-tp so that pp x dp x tp <= {have}." if tp > 1 else f"-pp/-dp so that pp x dp <= {have}.")
    )


def without_lost_nodes(nodes: Sequence[ClusterNode], lost: Collection[str], needed: int) -> list[ClusterNode]:
    """``nodes`` minus those a replica just lost, when the rest still hold ``needed`` units.

    Ray keeps listing a node that left as alive until its health checks fail (tens of seconds),
    and a placement group reserved there never becomes usable; so a replica placed again
    prefers other nodes, and falls back to every listed node rather than not placing at all.
    """
    kept = [n for n in nodes if n.node_id not in lost]
    return kept if sum(max(0, n.mlx_units) for n in kept) >= needed else list(nodes)


def place_stages(
    nodes: Sequence[ClusterNode],
    pipeline_parallel_size: int,
    data_parallel_size: int,
    *,
    local: bool = False,
    head_address: str | None = None,
    tensor_parallel_size: int = 1,
) -> Placement:
    """Choose a node for every (replica, rank, member), one ``mlx`` unit each.

    Rank 0 of every replica goes to the head node (where the gateway and coordinator run, so the hop
    gateway -> entry stage stays local) while it has units; a replica's other ranks go to distinct nodes
    when possible (PP exists for models too big for one Mac, so two ranks of one replica on one node is the
    fallback, not the goal); so do the workers of a tensor-parallel group (a group on one Mac shares its memory
    bandwidth). Too few units raise ``PlacementError``; ``local`` and ``head_address`` only shape its message.
    """
    pp, dp, tp = pipeline_parallel_size, data_parallel_size, tensor_parallel_size
    _check_sizes(pp, dp)
    if tp < 1:
        raise PlacementError(f"--tensor-parallel-size/-tp must be at least 1, got {tp}.")
    needed = pp * dp * tp
    if sum(max(0, n.mlx_units) for n in nodes) < needed:
        raise _not_enough_units(nodes, needed, pp, dp, local, head_address, tp)

    order = {n.node_id: i for i, n in enumerate(nodes)}
    remaining = {n.node_id: n.mlx_units for n in nodes if n.mlx_units > 0}
    by_id = {n.node_id: n for n in nodes}

    def pick(candidates: list[str], prefer_head: bool) -> str:
        # Rank 0 wants the head; other ranks avoid it (keeping its units for the
        # next replica's entry), then take the fullest node, then cluster order.
        def key(node_id: str) -> tuple:
            head_rank = 0 if by_id[node_id].is_head == prefer_head else 1
            return (head_rank, -remaining[node_id], order[node_id])

        return min(candidates, key=key)

    replicas = []
    for replica in range(dp):
        used: set[str] = set()
        slots = []
        for rank in range(pp):
            for member in range(tp):
                free = [nid for nid, units in remaining.items() if units > 0]
                fresh = [nid for nid in free if nid not in used]
                node_id = pick(fresh or free, prefer_head=(rank == 0 and member == 0))
                remaining[node_id] -= 1
                used.add(node_id)
                slots.append(StageSlot(replica, rank, node_id, by_id[node_id].address, member))
        replicas.append(tuple(slots))
    return Placement(pp, dp, tuple(replicas), tp)


def check_port_ranges(total_stages: int, ring_base_port: int, grpc_base_port: int,
                      tensor_parallel_size: int = 1) -> None:
    """Refuse bases whose ranges leave [1024, 65535] or overlap.

    The ring, control-lane and group ports take ``[ring_base, ring_base + data_plane_ports)``
    (``2 * total`` at -tp 1), gRPC takes ``[grpc_base, grpc_base + total * tp)`` (``stagemesh_core.ports``).
    """
    if total_stages < 1:
        raise PlacementError(f"a mesh needs at least one stage, got {total_stages}")
    tp = tensor_parallel_size
    try:
        stage_ports(0, total_stages, ring_base_port, grpc_base_port)
        check_port_base("--ring-base-port", ring_base_port, data_plane_ports(total_stages, tp))
        check_port_base("--grpc-base-port", grpc_base_port, total_stages * tp)
    except PortRangeError as exc:
        raise PlacementError(str(exc)) from None
    ring = range(ring_base_port, ring_base_port + data_plane_ports(total_stages, tp))
    grpc = range(grpc_base_port, grpc_base_port + total_stages * tp)
    if ring.start < grpc.stop and grpc.start < ring.stop:
        raise PlacementError(
            f"--ring-base-port {ring_base_port} (ring and control lanes use "
            f"{ring.start}..{ring.stop - 1}) overlaps --grpc-base-port {grpc_base_port} "
            f"(gRPC uses {grpc.start}..{grpc.stop - 1}); move one of them."
        )


def pipeline_plan(
    replica: int,
    hosts: Sequence[str],
    *,
    data_parallel_size: int,
    model_path: str,
    num_layers: int,
    compute_dtype: str,
    layer_split: str | None = None,
    layers: Sequence[LayerRange] | None = None,
    ring_base_port: int,
    grpc_base_port: int,
    dequantize: str = "auto",
    model_is_default: bool = False,
    load_format: str = "auto",
    hop_transport: str = "lane",
    first_layers: int | None = None,
    tensor_parallel_size: int = 1,
    tp_backend: str = "ring",
) -> PipelinePlan:
    """One replica's plan: rank r's worker m on ``hosts[r * T + m]``, ports from global index ``replica * P + r``.

    ``layers`` (the layer planner's ranges, ``coordinator.layer_planner``) wins over ``layer_split``."""
    tp = tensor_parallel_size
    if tp < 1 or len(hosts) % tp:
        raise ValueError(f"{len(hosts)} worker hosts for groups of {tp}")
    pp = len(hosts) // tp
    _check_sizes(pp, data_parallel_size)
    if not 0 <= replica < data_parallel_size:
        raise ValueError(f"replica {replica} outside 0..{data_parallel_size - 1}")
    total = pp * data_parallel_size
    check_port_ranges(total, ring_base_port, grpc_base_port, tp)
    ranges = tuple(layers) if layers is not None else plan_layer_split(num_layers, pp, layer_split)
    if len(ranges) != pp or ranges[0].start != 0 or ranges[-1].end != num_layers or any(
            a.end != b.start for a, b in zip(ranges, ranges[1:])):
        raise ValueError(f"layer ranges {[str(r) for r in ranges]} do not tile {num_layers} layers over {pp} stages")
    stages = []
    for rank, span in enumerate(ranges):
        g = replica * pp + rank
        ports = stage_ports(g, total, ring_base_port, grpc_base_port)
        stages.append(StagePlacement(
            rank=rank, global_index=g, layers=span, host=hosts[rank * tp],
            ring_port=ports.ring, lane_port=ports.lane, grpc_port=ports.grpc,
        ))
    member_hosts = {(rank, m): hosts[rank * tp + m] for rank in range(pp) for m in range(1, tp)}
    leaders, members = with_groups(tuple(stages), member_hosts, total, tp, ring_base_port, grpc_base_port)
    return PipelinePlan(
        replica=replica, model_path=model_path, num_layers=num_layers,
        compute_dtype=compute_dtype, stages=leaders, dequantize=dequantize,
        model_is_default=model_is_default, load_format=load_format, hop_transport=hop_transport,
        first_layers=first_layers, tensor_parallel_size=tp, tp_backend=tp_backend, members=members,
    )


def pipeline_plans(
    placement: Placement,
    hosts: Mapping[str, str] | None = None,
    **plan_args,
) -> tuple[PipelinePlan, ...]:
    """Plans for every replica of ``placement``.

    ``hosts`` maps node id -> advertised address (``STAGEMESH_HOST_IP`` as each
    node's StageHost reported it); nodes missing from it use the address Ray
    knows them by.
    """
    hosts = hosts or {}
    return tuple(
        pipeline_plan(
            replica,
            [hosts.get(s.node_id, s.address) for s in slots],
            data_parallel_size=placement.data_parallel_size,
            tensor_parallel_size=placement.tensor_parallel_size,
            **plan_args,
        )
        for replica, slots in enumerate(placement.replicas)
    )


def assign_gpus(nodes: Sequence[str], gpu_counts: Mapping[str, int],
                held: Iterable[tuple[str, int]] = ()) -> list[int | None]:
    """The GPU each stage takes on its node: ``nodes[i]`` is stage i's node, in global stage order.

    Each stage takes its node's least used GPU (the lowest index on a tie), so from scratch the
    stages of a node take its GPUs round robin: a stage's GPU is its ordinal among the stages on
    its node modulo the node's GPU count. ``held`` are ``(node, GPU)`` of stages that keep running
    (the other replicas, when one replica starts again): their GPUs count as used, so the restarted
    replica does not pile onto a busy GPU. None for a node without GPUs to assign (Metal, CPU).
    """
    uses: dict[str, list[int]] = {}
    for node, gpu in held:
        count = gpu_counts.get(node, 0)
        if count > 0:
            uses.setdefault(node, [0] * count)[gpu % count] += 1
    chosen: list[int | None] = []
    for node in nodes:
        count = gpu_counts.get(node, 0)
        if count <= 0:
            chosen.append(None)
            continue
        node_uses = uses.setdefault(node, [0] * count)
        gpu = min(range(count), key=lambda g: (node_uses[g], g))
        node_uses[gpu] += 1
        chosen.append(gpu)
    return chosen
