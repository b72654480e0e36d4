"""Where a replica's stages run: its placement group, StageHosts, GPUs, layer ranges and pipeline plan.

``ReplicaHosts`` (one per mesh, sharing the coordinator's replicas and lock) offers ``reserve``,
``describe``, ``assign_gpus``, ``plan``, ``options``, ``alive`` and ``place_again``. Each stage gets one
GPU of its node without taking another replica's; a replica's ``PipelinePlan`` uses the addresses its hosts
advertise, and a request that cannot fit raises ``PlanError``. A replica whose hosts stop answering is
placed again on the cluster's live nodes, avoiding the lost nodes for ``LOST_NODE_S``. It is the
coordinator's (``coordinator.mesh``) view of Ray; ``coordinator.launch`` starts the stages it placed.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace

from coordinator.config import MeshConfig, stage_options
from coordinator.health import StageChannel
from coordinator.layer_planner import MemoryPlan, StageSeat, auto_kv_tokens, format_plan, plan_pipeline
from coordinator.placement import StageSlot, assign_gpus, pipeline_plan, place_stages, without_lost_nodes
from coordinator.ray_cluster import RaySession, cluster_nodes, head_address, release_bundles, reserve_bundles
from coordinator.replica import LiveReplica, LiveStage
from coordinator.stage_host import stage_host_actor
from coordinator.supervision import ReplicaRecord
from stagemesh_core import settings
from stagemesh_core.gpus import stage_has_own_gpu
from stagemesh_core.layer_split import LayerRange
from stagemesh_core.memory import NodeMemory, stages_sharing_memory
from stagemesh_core.plan import StageOptions

log = logging.getLogger("stagemesh.coordinator")

ACTOR_CALL_S = 10.0  # a StageHost answers at once unless its node is in trouble
ACTOR_START_S = 60.0  # creating an actor starts a Python worker on its node
LOST_NODE_S = 120.0  # how long a node whose StageHost vanished is avoided when placing again

EventSink = Callable[..., None]  # (kind, message, *, replica=None, rank=None): records and publishes


class ReplicaHosts:
    def __init__(self, config: MeshConfig, mesh_token: str, replicas: list[LiveReplica], lock: threading.RLock,
                 clock: Callable[[], float], on_event: EventSink) -> None:
        self.config = config
        self._mesh_token = mesh_token
        self._replicas = replicas  # the coordinator's list: every replica, for GPU and node sharing
        self._lock = lock
        self._clock = clock
        self._on_event = on_event
        self._lost_nodes: dict[str, float] = {}  # node id -> when a StageHost on it stopped answering
        self._node_memory: dict[str, NodeMemory] = {}  # node id -> what its StageHost reported
        self.memory_plans: dict[int, MemoryPlan] = {}  # replica -> its layer plan (with model_facts)

    def reserve(self, index: int, slots: Sequence[StageSlot]) -> LiveReplica:
        """One placement group for replica ``index`` (one ``{"mlx": 1, "CPU": 0.01}`` bundle per stage) and a
        ``StageHost`` actor in each bundle."""
        group = reserve_bundles(slots, self.config.placement_timeout_s, name=f"stagemesh-replica-{index}")
        stages = [LiveStage(index, slot, stage_host_actor(group, i, label=f"r{index}-s{slot.rank}"))
                  for i, slot in enumerate(slots)]
        return LiveReplica(index, group, stages, ReplicaRecord(index))

    def describe(self, replica: LiveReplica, timeout_s: float = ACTOR_START_S) -> None:
        """Record the address, Python and GPUs each host of ``replica`` reports."""
        import ray

        infos = ray.get([s.actor.describe.remote() for s in replica.stages], timeout=timeout_s)
        for stage, info in zip(replica.stages, infos):
            stage.host = info
            if info.host_source != "ray node address":
                log.info("replica %d stage %d: node %s advertises %s (from %s)", replica.index,
                         stage.rank, info.node_id[:8], info.host, info.host_source)
            if info.python.rsplit(".", 1)[0] != ".".join(map(str, sys.version_info[:2])):
                log.warning("replica %d stage %d: node %s runs Python %s, the coordinator %s",
                            replica.index, stage.rank, info.hostname, info.python, sys.version.split()[0])

    def assign_gpus(self, replica: LiveReplica) -> None:
        """Give each stage of ``replica`` one GPU of its node; the other replicas keep theirs. Caller holds
        the lock. Every replica is planned before any launches, so each stage's launch counts its GPU's
        sharers among all of them."""
        held = [(s.slot.node_id, s.gpu_index) for r in self._replicas if r is not replica for s in r.stages
                if s.gpu_index is not None]
        counts = {s.slot.node_id: s.host.gpu_count if s.host else 0 for s in replica.stages}
        for stage, gpu in zip(replica.stages, assign_gpus([s.slot.node_id for s in replica.stages], counts, held)):
            stage.gpu_index = gpu

    def plan(self, replica: LiveReplica) -> None:
        """Set ``replica``'s ``PipelinePlan`` from the addresses its hosts advertise, and each stage's channel.

        With the model's facts the layer planner chooses the ranges from each node's own memory
        (``memory_plans``), else the split is even or ``--pp-layer-split``. A request that cannot fit raises
        ``PlanError``."""
        cfg = self.config
        with self._lock:
            if any(s.gpu_index is None for s in replica.stages):  # new hosts (placed again), or no GPUs at all
                self.assign_gpus(replica)  # before planning: a stage's GPU decides whose memory it shares
        plan = pipeline_plan(
            replica.index, replica.host_addresses(),
            data_parallel_size=cfg.data_parallel_size, model_path=cfg.model_path,
            num_layers=cfg.num_layers, compute_dtype=cfg.compute_dtype, layer_split=cfg.layer_split,
            layers=self._layer_ranges(replica),
            ring_base_port=cfg.ring_base_port, grpc_base_port=cfg.grpc_base_port, dequantize=cfg.dequantize,
            model_is_default=cfg.model_is_default, load_format=cfg.load_format,
            hop_transport=cfg.hop_transport, first_layers=cfg.first_layers,
            tensor_parallel_size=cfg.tensor_parallel_size, tp_backend=cfg.tp_backend,
        )
        with self._lock:
            replica.plan = plan
            for stage, placement in zip(replica.stages, plan.workers):
                target = f"{placement.host}:{placement.grpc_port}"
                if stage.channel is None or stage.channel.target != target:
                    if stage.channel is not None:
                        stage.channel.close()
                    stage.channel = StageChannel(target, self._mesh_token, cfg.grpc_tls)
                stage.placement = placement
                stage.compute_dtype = stage.compute_dtype or cfg.compute_dtype

    def options(self, replica: LiveReplica) -> list[StageOptions]:
        """Each stage's ``StageOptions``, with the count of stages sharing its node and GPU."""
        return [stage_options(self.config, s.slot.node_id, self._stages_on_node(s.slot.node_id), s.gpu_index,
                              self._stages_on_gpu(s.slot.node_id, s.gpu_index))
                for s in replica.stages]

    def alive(self, replica: LiveReplica) -> bool:
        """Whether ``replica``'s hosts still answer; if not, the nodes that lost theirs are noted (``node_lost``
        events) so ``place_again`` avoids them for ``LOST_NODE_S``."""
        try:
            self.describe(replica, timeout_s=ACTOR_CALL_S)
            return True
        except Exception as exc:
            log.warning("replica %d: a StageHost is unreachable (%s); placing the replica again",
                        replica.index, type(exc).__name__)
            self._remember_lost_nodes(replica)
            return False

    def place_again(self, replica: LiveReplica, session: RaySession | None) -> None:
        """Place ``replica`` again on the cluster's live nodes (its old host actors are gone); journals
        ``replica_replaced``."""
        import ray

        cfg = self.config
        for stage in replica.stages:
            try:
                ray.kill(stage.actor)
            except Exception:
                pass
        release_bundles(replica.group)
        held: dict[str, int] = {}
        for other in self._replicas:
            if other is not replica:
                for stage in other.stages:
                    held[stage.slot.node_id] = held.get(stage.slot.node_id, 0) + 1
        nodes = [replace(n, mlx_units=n.mlx_units - held.get(n.node_id, 0))
                 for n in cluster_nodes(session.driver_node_id if session else None)]
        now = self._clock()
        lost = {node for node, when in self._lost_nodes.items() if now - when < LOST_NODE_S}
        nodes = without_lost_nodes(nodes, lost, cfg.pipeline_parallel_size * cfg.tensor_parallel_size)
        local = bool(session and session.local)
        placement = place_stages(nodes, cfg.pipeline_parallel_size, 1, local=local, head_address=head_address(nodes),
                                 tensor_parallel_size=cfg.tensor_parallel_size)
        slots = [replace(s, replica=replica.index) for s in placement.replicas[0]]
        fresh = self.reserve(replica.index, slots)
        with self._lock:
            for old in replica.stages:
                if old.channel is not None:
                    old.channel.close()
            replica.group, replica.stages = fresh.group, fresh.stages
        self.describe(replica)
        hosts = ", ".join(replica.host_addresses())
        self._on_event("replica_replaced", f"placed again on {hosts}", replica=replica.index)
        log.info("replica %d placed again on %s", replica.index, hosts)

    # -- helpers --------------------------------------------------------------

    def _stages_on_node(self, node_id: str) -> int:
        return sum(1 for r in self._replicas for s in r.stages if s.slot.node_id == node_id) or 1

    def _stages_on_gpu(self, node_id: str, gpu_index: int | None) -> int:
        if gpu_index is None:
            return 0
        return sum(1 for r in self._replicas for s in r.stages
                   if s.slot.node_id == node_id and s.gpu_index == gpu_index) or 1

    def _seats(self, replica: LiveReplica) -> list[StageSeat]:
        """Where each stage of ``replica`` runs, with its node's own memory facts (asked once per node)."""
        import ray

        missing = {s.slot.node_id: s for s in replica.stages if s.slot.node_id not in self._node_memory}
        answers = ray.get([s.actor.node_memory.remote() for s in missing.values()], timeout=ACTOR_START_S)
        self._node_memory.update(zip(missing, answers))
        seats = []
        for s in replica.stages:
            memory = self._node_memory[s.slot.node_id]
            own_gpu = stage_has_own_gpu(s.gpu_index, settings.GPU_PER_STAGE)
            sharing = stages_sharing_memory(memory.backend, self._stages_on_node(s.slot.node_id),
                                            self._stages_on_gpu(s.slot.node_id, s.gpu_index), own_gpu)
            seats.append(StageSeat(s.slot.node_id, s.host.host if s.host else s.slot.address, memory, sharing,
                                   s.host.hostname if s.host else ""))
        return seats

    def _layer_ranges(self, replica: LiveReplica) -> tuple[LayerRange, ...] | None:
        """The layer planner's ranges for ``replica`` (None without the model's facts); raises ``PlanError``.
        With tensor parallelism each stage is planned where its worker 0 runs, with a worker's share of the
        model (``MeshConfig.planned_facts``)."""
        facts = self.config.planned_facts()
        if facts is None:
            return None
        seats = [seat for stage, seat in zip(replica.stages, self._seats(replica)) if stage.member == 0]
        request = self.config.plan_request()
        stages, chosen_by = plan_pipeline(facts, seats, request, replica.index)
        auto = self.config.auto_kv_facts()  # the log's plan states a quantized KV's context against auto's
        plan = MemoryPlan(request, (stages,), chosen_by,
                          (auto_kv_tokens(auto, seats, request, replica.index),) if auto is not None else ())
        self.memory_plans[replica.index] = plan
        log.info("replica %d layer plan:\n%s", replica.index, format_plan(plan))
        return plan.ranges(0)

    def _remember_lost_nodes(self, replica: LiveReplica) -> None:
        """Note the nodes whose StageHost does not answer, so placing again avoids them."""
        import ray

        for stage in replica.stages:
            try:
                ray.get(stage.actor.describe.remote(), timeout=ACTOR_CALL_S)
            except Exception:
                self._lost_nodes[stage.slot.node_id] = self._clock()
                self._on_event("node_lost", f"node {stage.slot.node_id[:8]} lost its StageHost",
                               replica=replica.index, rank=stage.rank)
                log.warning("replica %d stage %d: node %s lost its StageHost; placing elsewhere while "
                            "others have room", replica.index, stage.rank, stage.slot.node_id[:8])
