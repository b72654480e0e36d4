"""MeshCoordinator: place, start, watch, restart and stop every stage of the mesh with Ray.

Lifecycle:

- ``start()``: join (``RAY_ADDRESS``) or start a loopback Ray, place ``P * D``
  stages (``placement.place_stages``), reserve one ``{"mlx": 1, "CPU":
  0.01}`` bundle per stage (one placement group per replica), put a
  ``StageHost`` actor in each, build every replica's plan from the addresses
  the hosts advertise, start all ranks of each replica together (each rank
  waits for its neighbours) and wait until every stage's gRPC health says
  SERVING, logging each stage's progress. Any failure stops everything and
  raises ``MeshStartError`` with the failing stage's log tail.
- Layers: with the model's facts (``MeshConfig.model_facts``), each node's
  StageHost reports its own memory and backend (``StageHost.node_memory``)
  and the layer planner (``coordinator.layer_planner``) chooses every
  replica's ranges, or checks ``--pp-layer-split``, before any stage starts;
  a request that cannot fit raises ``PlanError`` with its numbers. Without
  them (tests' fake stages) the split is even or ``--pp-layer-split``.
- Supervision: one thread per replica checks its stages every
  ``health_interval_s`` (gRPC health + stage info with a short deadline, and
  ``StageHost.poll``). A stage that is not serving is marked unhealthy in the
  snapshot at once; a failed one (exited, host gone, FAILED, or not serving
  for ``unhealthy_after_misses`` checks) makes the coordinator stop the whole
  replica (a broken MLX ring cannot be repaired in place), wait until its ports
  are free, and start it again with the same plan, with backoff and a cap
  (``health.RestartPolicy``). A replica whose host actor is gone is placed
  again from the cluster's live nodes (the plan's hosts may change).
- ``snapshot()``: the current ``MeshSnapshot`` (immutable; any thread), with
  the recent events (stage lost, replica restarting / re-placed / serving
  again, node lost) from the coordinator's ``EventJournal``.
- ``stop()``: SIGTERM the entry stage of each replica first (it stops its
  pipeline cleanly), then the rest, SIGKILL stragglers, kill the actors,
  remove the placement groups, and shut down a Ray it started. Idempotent;
  afterwards no stage process runs and no stage port is bound.
"""

from __future__ import annotations

import atexit
import logging
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from coordinator.health import (
    RestartPolicy,
    StageChannel,
    StageInfoView,
    StageProbe,
    Verdict,
    judge,
)
from coordinator.layer_planner import MemoryPlan, PlanRequest, StageSeat, format_plan, plan_pipeline
from coordinator.placement import (
    ClusterNode,
    PlacementError,
    StageSlot,
    assign_gpus,
    check_port_ranges,
    pipeline_plan,
    place_stages,
    without_lost_nodes,
)
from coordinator.ray_cluster import (
    RaySession,
    cluster_nodes,
    connect_ray,
    disconnect,
    head_address,
    release_bundles,
    reserve_bundles,
)
from coordinator.stage_host import DEFAULT_STAGE_COMMAND, HostInfo, stage_host_actor
from stagemesh.core import defaults, settings
from stagemesh.core.events import EventJournal
from stagemesh.core.gpus import stage_has_own_gpu
from stagemesh.core.grpc_tls import TlsFiles
from stagemesh.core.layer_split import LayerRange, plan_layer_split
from stagemesh.core.memory import ModelFacts, NodeMemory, stages_sharing_memory
from stagemesh.core.mesh_token import generate_token
from stagemesh.core.plan import PipelinePlan, StageLaunch, StageOptions, StagePlacement
from stagemesh.core.settings import DEFAULT_GRPC_BASE_PORT, DEFAULT_RING_BASE_PORT
from stagemesh.core.snapshots import MeshSnapshot, ReplicaSnapshot, StageSnapshot, StageStats
from stagemesh.core.states import StageState, caused_by_neighbour

log = logging.getLogger("stagemesh.coordinator")

_ACTOR_CALL_S = 10.0  # a StageHost answers at once unless its node is in trouble
_ACTOR_START_S = 60.0  # creating an actor starts a Python worker on its node
_PORTS_FREE_S = 30.0
_LOST_NODE_S = 120.0  # how long a node whose StageHost vanished is avoided when placing again
_STARTUP_POLL_S = 0.25


class MeshStartError(RuntimeError):
    """The mesh did not come up; the message names the stage and carries its log tail."""


@dataclass(frozen=True)
class MeshConfig:
    model_path: str
    served_model_name: str
    num_layers: int
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    compute_dtype: str = "auto"
    dequantize: str = "auto"  # --dequantize
    load_format: str = "auto"  # --load-format: dummy gives every stage random weights for its slice
    hop_transport: str = "lane"  # --hop-transport: how hidden states travel between stages (lane or ring)
    memory_fraction: float | None = None  # --memory-fraction (None: the stage's default)
    model_is_default: bool = False  # no MODEL given: every node uses its own embedded default
    layer_split: str | None = None  # --pp-layer-split
    ring_base_port: int = DEFAULT_RING_BASE_PORT
    grpc_base_port: int = DEFAULT_GRPC_BASE_PORT
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool | None = None  # --enable-prefix-caching / --no-enable-prefix-caching
    prefix_cache_block_size: int | None = None  # --prefix-cache-block-size
    ray_address: str | None = None  # None: RAY_ADDRESS, else a local loopback Ray
    startup_timeout_s: float = defaults.STARTUP_TIMEOUT_S
    placement_timeout_s: float = 30.0
    connect_timeout_s: float = defaults.CONNECT_TIMEOUT_S  # passed to each stage (--connect-timeout)
    health_interval_s: float = 1.0
    health_timeout_s: float = 1.0  # deadline of each health RPC
    unhealthy_after_misses: int = 3
    stop_grace_s: float = 5.0
    max_restarts: int = 5  # per replica within restart_window_s; then give up
    restart_window_s: float = 600.0
    restart_backoff_s: float = 1.0
    max_restart_backoff_s: float = 30.0
    stage_command: tuple[str, ...] = DEFAULT_STAGE_COMMAND  # after `python`; `--launch FILE` follows
    # The model's size (stage_worker.model_facts): the layer planner splits by each node's memory. None: even
    # split / --pp-layer-split, unchecked (the fake stages of the coordinator's tests have no model).
    model_facts: ModelFacts | None = None
    # Every stage's gRPC port requires it on state-changing calls; "" makes the coordinator generate one
    # (``MeshCoordinator.mesh_token``). repr=False: never in a log line.
    mesh_token: str = field(default="", repr=False)
    grpc_tls: TlsFiles | None = None  # mutual TLS to the stages (--grpc-tls-dir); None: plaintext

    @property
    def total_stages(self) -> int:
        return self.pipeline_parallel_size * self.data_parallel_size

    def plan_request(self) -> PlanRequest:
        """What the layer planner must fit (the stage's own defaults where the user left a flag unset)."""
        return PlanRequest(
            max_model_len=self.max_model_len or defaults.MAX_MODEL_LEN,
            max_num_seqs=self.max_num_seqs or defaults.MAX_NUM_SEQS,
            memory_fraction=self.memory_fraction or defaults.MEMORY_FRACTION, compute_dtype=self.compute_dtype,
            layer_split=self.layer_split)

    def restart_policy(self) -> RestartPolicy:
        return RestartPolicy(self.max_restarts, self.restart_window_s, self.restart_backoff_s,
                             self.max_restart_backoff_s)


def validate_config(config: MeshConfig) -> None:
    """Fail before touching Ray when the flags cannot describe a mesh."""
    if config.pipeline_parallel_size < 1 or config.data_parallel_size < 1:
        raise PlacementError(
            f"--pipeline-parallel-size/-pp and --data-parallel-size/-dp must be at least 1, got "
            f"{config.pipeline_parallel_size} and {config.data_parallel_size}."
        )
    plan_layer_split(config.num_layers, config.pipeline_parallel_size, config.layer_split)
    check_port_ranges(config.total_stages, config.ring_base_port, config.grpc_base_port)
    if config.health_interval_s <= 0 or config.unhealthy_after_misses < 1:
        raise ValueError("health_interval_s must be positive and unhealthy_after_misses at least 1")


def stage_options(config: MeshConfig, node_id: str, stages_on_node: int = 1, gpu_index: int | None = None,
                  stages_on_gpu: int = 0) -> StageOptions:
    """A serving stage's options; ``stages_on_node`` stages share its node's memory and cores, and
    ``stages_on_gpu`` the GPU ``gpu_index`` of its node (``placement.assign_gpus``; None: no GPU to
    assign). What the user left unset keeps the stage's default. ``stages_on_node`` is passed even when 1: the
    coordinator knows which stages share a node (two Ray nodes may share an address, as in a simulated
    cluster), and the layer plan sized each stage's budget by that count."""
    given: dict[str, Any] = {"memory_fraction": config.memory_fraction, "max_num_seqs": config.max_num_seqs,
                             "max_model_len": config.max_model_len,
                             "enable_prefix_caching": config.enable_prefix_caching,
                             "prefix_cache_block_size": config.prefix_cache_block_size}
    return StageOptions(node_id=node_id, connect_timeout_s=config.connect_timeout_s,
                        stages_on_host=stages_on_node, gpu_index=gpu_index,
                        stages_on_gpu=stages_on_gpu if gpu_index is not None else 0,
                        **{name: value for name, value in given.items() if value is not None})


@dataclass
class _Stage:
    """Mutable record of one stage; written under the coordinator's lock."""

    replica: int
    slot: StageSlot
    actor: Any
    placement: StagePlacement | None = None
    channel: StageChannel | None = None
    host: HostInfo | None = None
    pid: int | None = None
    state: StageState = StageState.STARTING
    exit_code: int | None = None  # the process's, once it exited
    healthy: bool = False
    error: str | None = None
    compute_dtype: str = ""
    quantized: bool = False
    blas: str = ""
    backend: str = ""  # MLX's backend the stage reports: cpu, metal, cuda
    device: str = ""  # the device's name it reports
    gpu_index: int | None = None  # the GPU of its node it was given (placement.assign_gpus)
    stats: StageStats = field(default_factory=StageStats)
    misses: int = 0
    started_at: float = 0.0

    @property
    def rank(self) -> int:
        return self.slot.rank

    @property
    def name(self) -> str:
        p = self.placement
        where = f" ({p.host} grpc :{p.grpc_port} ring :{p.ring_port})" if p else ""
        return f"replica {self.replica} stage {self.rank}{where}"


@dataclass
class _Replica:
    index: int
    group: Any
    stages: list[_Stage]
    plan: PipelinePlan | None = None
    phase: str = "starting"  # starting, serving, restarting, failed, stopped
    restarts: int = 0
    restart_times: list[float] = field(default_factory=list)
    thread: threading.Thread | None = None

    def host_addresses(self) -> list[str]:
        """The address each stage advertises; ``MeshCoordinator._describe_hosts`` has filled them in."""
        hosts = []
        for s in self.stages:
            assert s.host is not None, f"{s.name}: host not described yet"
            hosts.append(s.host.host)
        return hosts


class _ReplicaFailed(RuntimeError):
    def __init__(self, stage: _Stage, reason: str, log_tail: str) -> None:
        super().__init__(f"{stage.name} failed: {reason}" + (f"\n--- its log:\n{log_tail}" if log_tail else ""))
        self.stage = stage
        self.reason = reason


class MeshCoordinator:
    """Runs the mesh described by a ``MeshConfig`` (see the module docstring)."""

    def __init__(self, config: MeshConfig, *, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        validate_config(config)
        self.config = config
        self.mesh_token = config.mesh_token or generate_token()  # the gateway sends it too
        self._clock = clock
        self._wall_clock = wall_clock
        self._events = EventJournal(wall_clock=wall_clock)
        self._lock = threading.RLock()
        self._stop_lock = threading.Lock()
        self._stopping = threading.Event()
        self._stopped = False
        self._session: RaySession | None = None
        self._replicas: list[_Replica] = []
        self._lost_nodes: dict[str, float] = {}  # node id -> when a StageHost on it stopped answering
        self._nodes: list[ClusterNode] = []
        self._snapshot = MeshSnapshot(config.served_model_name, ())
        self._policy = config.restart_policy()
        self._node_memory: dict[str, NodeMemory] = {}  # node id -> what its StageHost reported
        self.memory_plans: dict[int, MemoryPlan] = {}  # replica -> its layer plan (with model_facts)

    # -- public API -----------------------------------------------------------

    def snapshot(self) -> MeshSnapshot:
        with self._lock:
            return self._snapshot

    def start(self) -> MeshSnapshot:
        """Bring every stage up and start supervising; raises ``MeshStartError`` or ``PlacementError``."""
        if self._session is not None or self._stopped:
            raise RuntimeError("MeshCoordinator.start() may be called once")
        cfg = self.config
        started = self._clock()
        atexit.register(self.stop)
        try:
            self._session = connect_ray(cfg.total_stages, address=cfg.ray_address)
            self._nodes = cluster_nodes(self._session.driver_node_id)
            placement = place_stages(
                self._nodes, cfg.pipeline_parallel_size, cfg.data_parallel_size,
                local=self._session.local, head_address=head_address(self._nodes),
            )
            for index, slots in enumerate(placement.replicas):
                self._replicas.append(self._reserve(index, slots))
            for replica in self._replicas:
                self._describe_hosts(replica)
                with self._lock:
                    self._assign_gpus(replica)  # all replicas' first: the layer plan counts each GPU's sharers
            for replica in self._replicas:
                self._plan(replica)
            self._publish()
            for replica in self._replicas:
                self._launch(replica)
            self._wait_serving(self._replicas, cfg.startup_timeout_s)
        except BaseException as exc:
            self.stop()
            if isinstance(exc, _ReplicaFailed):
                raise MeshStartError(str(exc)) from None
            raise
        self._event("mesh_serving", f"{cfg.data_parallel_size} replica(s) x {cfg.pipeline_parallel_size} stage(s) "
                    f"serving in {self._clock() - started:.1f} s")
        log.info("mesh serving: %d replica(s) x %d stage(s) in %.1f s (%s)",
                 cfg.data_parallel_size, cfg.pipeline_parallel_size, self._clock() - started,
                 "local Ray on loopback" if self._session.local else f"Ray at {self._session.address}")
        for replica in self._replicas:
            replica.thread = threading.Thread(
                target=self._supervise, args=(replica,), name=f"stagemesh-supervise-r{replica.index}",
                daemon=True)
            replica.thread.start()
        return self.snapshot()

    def stop(self) -> None:
        """Stop every stage, the actors, the placement groups and a Ray we started. Idempotent."""
        with self._stop_lock:
            if self._stopped:
                return
            self._stopping.set()
            began = self._clock()
            for replica in self._replicas:
                if replica.thread is not None and replica.thread is not threading.current_thread():
                    replica.thread.join(timeout=_ACTOR_CALL_S + self.config.stop_grace_s + 5)
            with ThreadPoolExecutor(max_workers=max(1, len(self._replicas))) as pool:
                list(pool.map(self._stop_replica_orderly, self._replicas))
            for replica in self._replicas:
                self._release(replica)
            disconnect(self._session)
            with self._lock:
                for replica in self._replicas:
                    replica.phase = "stopped"
                    for stage in replica.stages:
                        stage.state, stage.healthy, stage.pid = StageState.STOPPED, False, None
                if self._replicas:
                    self._events.record("mesh_stopped", "every stage stopped")
                self._publish()
            self._stopped = True
            atexit.unregister(self.stop)
            if self._replicas:
                log.info("mesh stopped in %.1f s", self._clock() - began)

    # -- placement and hosts --------------------------------------------------

    def _reserve(self, replica: int, slots: Sequence[StageSlot]) -> _Replica:
        """One placement group for the replica and a StageHost in each of its bundles."""
        group = reserve_bundles(slots, self.config.placement_timeout_s, name=f"stagemesh-replica-{replica}")
        stages = [
            _Stage(replica, slot, stage_host_actor(group, i, label=f"r{replica}-s{slot.rank}"))
            for i, slot in enumerate(slots)
        ]
        return _Replica(replica, group, stages)

    def _describe_hosts(self, replica: _Replica, timeout_s: float = _ACTOR_START_S) -> None:
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

    def _seats(self, replica: _Replica) -> list[StageSeat]:
        """Where each stage of ``replica`` runs, with its node's own memory facts (asked once per node)."""
        import ray

        missing = {s.slot.node_id: s for s in replica.stages if s.slot.node_id not in self._node_memory}
        answers = ray.get([s.actor.node_memory.remote() for s in missing.values()], timeout=_ACTOR_START_S)
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

    def _layer_ranges(self, replica: _Replica) -> tuple[LayerRange, ...] | None:
        """The layer planner's ranges for ``replica`` (None without the model's facts); raises ``PlanError``."""
        facts = self.config.model_facts
        if facts is None:
            return None
        stages, chosen_by = plan_pipeline(facts, self._seats(replica), self.config.plan_request(), replica.index)
        plan = MemoryPlan(self.config.plan_request(), (stages,), chosen_by)
        self.memory_plans[replica.index] = plan
        log.info("replica %d layer plan:\n%s", replica.index, format_plan(plan))
        return plan.ranges(0)

    def _plan(self, replica: _Replica) -> None:
        cfg = self.config
        with self._lock:
            if any(s.gpu_index is None for s in replica.stages):  # new hosts (placed again), or no GPUs at all
                self._assign_gpus(replica)  # before planning: a stage's GPU decides whose memory it shares
        plan = pipeline_plan(
            replica.index, replica.host_addresses(),
            data_parallel_size=cfg.data_parallel_size, model_path=cfg.model_path,
            num_layers=cfg.num_layers, compute_dtype=cfg.compute_dtype, layer_split=cfg.layer_split,
            layers=self._layer_ranges(replica),
            ring_base_port=cfg.ring_base_port, grpc_base_port=cfg.grpc_base_port, dequantize=cfg.dequantize,
            model_is_default=cfg.model_is_default, load_format=cfg.load_format,
            hop_transport=cfg.hop_transport,
        )
        with self._lock:
            replica.plan = plan
            for stage, placement in zip(replica.stages, plan.stages):
                target = f"{placement.host}:{placement.grpc_port}"
                if stage.channel is None or stage.channel.target != target:
                    if stage.channel is not None:
                        stage.channel.close()
                    stage.channel = StageChannel(target, self.mesh_token, self.config.grpc_tls)
                stage.placement = placement
                stage.compute_dtype = stage.compute_dtype or cfg.compute_dtype

    def _assign_gpus(self, replica: _Replica) -> None:
        """Give each stage of ``replica`` one GPU of its node; the other replicas keep theirs. Caller holds
        the lock. Every replica is planned before any launches, so each stage's launch counts its GPU's
        sharers (``_stages_on_gpu``) among all of them."""
        held = [(s.slot.node_id, s.gpu_index) for r in self._replicas if r is not replica for s in r.stages
                if s.gpu_index is not None]
        counts = {s.slot.node_id: s.host.gpu_count if s.host else 0 for s in replica.stages}
        for stage, gpu in zip(replica.stages, assign_gpus([s.slot.node_id for s in replica.stages], counts, held)):
            stage.gpu_index = gpu

    def _replace_hosts(self, replica: _Replica) -> None:
        """Place ``replica`` again on live nodes (its old host actors are gone)."""
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
                 for n in cluster_nodes(self._session.driver_node_id if self._session else None)]
        now = self._clock()
        lost = {node for node, when in self._lost_nodes.items() if now - when < _LOST_NODE_S}
        nodes = without_lost_nodes(nodes, lost, cfg.pipeline_parallel_size)
        local = bool(self._session and self._session.local)
        placement = place_stages(nodes, cfg.pipeline_parallel_size, 1, local=local, head_address=head_address(nodes))
        slots = [replace(s, replica=replica.index) for s in placement.replicas[0]]
        fresh = self._reserve(replica.index, slots)
        with self._lock:
            for old in replica.stages:
                if old.channel is not None:
                    old.channel.close()
            replica.group, replica.stages = fresh.group, fresh.stages
        self._describe_hosts(replica)
        hosts = ", ".join(replica.host_addresses())
        self._event("replica_replaced", f"placed again on {hosts}", replica=replica.index)
        log.info("replica %d placed again on %s", replica.index, hosts)

    # -- starting -------------------------------------------------------------

    def _launch(self, replica: _Replica) -> None:
        """Start every rank of ``replica`` at once, once their ports are free."""
        import ray

        plan = replica.plan
        assert plan is not None
        busy = ray.get([
            s.actor.busy_ports.remote(p.host, [p.ring_port, p.lane_port, p.grpc_port])
            for s, p in zip(replica.stages, plan.stages)
        ], timeout=_ACTOR_CALL_S)
        deadline = self._clock() + _PORTS_FREE_S
        while any(busy):
            if self._clock() > deadline:
                taken = "; ".join(f"{p.host}: {ports}" for p, ports in zip(plan.stages, busy) if ports)
                raise PlacementError(
                    f"replica {replica.index}: ports still in use after {_PORTS_FREE_S:.0f} s ({taken}); "
                    f"stop whatever holds them or choose other --ring-base-port / --grpc-base-port")
            if self._stopping.wait(0.25):
                raise _Stopping()
            busy = ray.get([
                s.actor.busy_ports.remote(p.host, [p.ring_port, p.lane_port, p.grpc_port])
                for s, p in zip(replica.stages, plan.stages)
            ], timeout=_ACTOR_CALL_S)
        for stage, p in zip(replica.stages, plan.stages):
            gpu = f", GPU {stage.gpu_index}" if stage.gpu_index is not None else ""
            log.info("replica %d stage %d: loading layers %s on %s grpc :%d ring :%d (node %s%s)",
                     replica.index, stage.rank, p.layers, p.host, p.grpc_port, p.ring_port, stage.slot.node_id[:8],
                     gpu)
        pids = ray.get([
            s.actor.start.remote(
                StageLaunch(plan, s.rank, stage_options(
                    self.config, s.slot.node_id, self._stages_on_node(s.slot.node_id), s.gpu_index,
                    self._stages_on_gpu(s.slot.node_id, s.gpu_index)), mesh_token=self.mesh_token,
                    grpc_tls_dir=self.config.grpc_tls.directory if self.config.grpc_tls else "").to_json(),
                self.config.stage_command)
            for s in replica.stages
        ], timeout=_ACTOR_CALL_S)
        now = self._clock()
        with self._lock:
            replica.phase = "starting"
            for stage, pid in zip(replica.stages, pids):
                stage.pid, stage.state, stage.healthy, stage.error = pid, StageState.STARTING, False, None
                stage.exit_code = None
                stage.misses, stage.started_at = 0, now
            self._publish()

    def _wait_serving(self, replicas: Sequence[_Replica], timeout_s: float) -> None:
        """Until every stage of ``replicas`` serves; raises ``_ReplicaFailed`` on the first failure."""
        deadline = self._clock() + timeout_s
        while True:
            pending = [r for r in replicas if r.phase == "starting"]
            if not pending:
                return
            for replica in pending:
                verdicts = self._check(replica, starting=True)
                for stage, (verdict, reason) in zip(replica.stages, verdicts):
                    if verdict is Verdict.FAILED:
                        raise _ReplicaFailed(stage, reason or "failed", self._log_tail(stage))
                if all(v is Verdict.SERVING for v, _ in verdicts):
                    with self._lock:
                        replica.phase = "serving"
                        if replica.restarts:
                            self._events.record("replica_serving", f"serving again after restart {replica.restarts}",
                                                replica=replica.index)
                        self._publish()
                    log.info("replica %d: serving (%d stage(s), %.1f s)", replica.index, len(replica.stages),
                             self._clock() - replica.stages[0].started_at)
            if self._clock() > deadline:
                late = [s for r in replicas for s in r.stages if not s.healthy]
                stage = late[0] if late else replicas[0].stages[0]
                raise _ReplicaFailed(
                    stage, f"not serving after {timeout_s:.0f} s (state {stage.state.value}); raise the startup "
                    f"timeout for big models", self._log_tail(stage))
            if self._stopping.wait(_STARTUP_POLL_S):
                raise _Stopping()

    # -- checking -------------------------------------------------------------

    def _probe(self, replica: _Replica) -> list[StageProbe]:
        """Probe every stage of ``replica`` in parallel: process, health and info."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        timeout = self.config.health_timeout_s
        polls = [s.actor.poll.remote() for s in replica.stages]
        rpcs = [s.channel.start_probe(timeout) if s.channel else None for s in replica.stages]
        ray.wait(polls, num_returns=len(polls), timeout=max(timeout, 2.0))
        probes = []
        for ref, rpc in zip(polls, rpcs):
            exit_code, lost, poll_error = None, None, None
            try:
                exit_code = ray.get(ref, timeout=0)
            except RayActorError as exc:
                lost = type(exc).__name__
            except GetTimeoutError:
                poll_error = "its StageHost did not answer"
            health, info, rpc_error = StageChannel.finish_probe(rpc) if rpc else (None, None, "no channel")
            probes.append(StageProbe(exit_code=exit_code, host_lost=lost, health=health, info=info,
                                     rpc_error=rpc_error or poll_error))
        return probes

    def _check(self, replica: _Replica, *, starting: bool) -> list[tuple[Verdict, str | None]]:
        """Probe, judge and record every stage of ``replica``; publishes a new snapshot."""
        probes = self._probe(replica)
        verdicts = []
        with self._lock:
            for stage, probe in zip(replica.stages, probes):
                verdict, reason = judge(probe, starting=starting, misses=stage.misses,
                                        max_misses=self.config.unhealthy_after_misses)
                self._record(stage, probe, verdict, reason)
                verdicts.append((verdict, reason))
            self._publish()
        return verdicts

    def _record(self, stage: _Stage, probe: StageProbe, verdict: Verdict, reason: str | None) -> None:
        previous = stage.state
        info: StageInfoView | None = probe.info
        if info is not None:
            stage.compute_dtype = info.compute_dtype or stage.compute_dtype
            stage.quantized = info.quantized
            stage.blas = info.blas or stage.blas
            stage.backend = info.backend or stage.backend
            stage.device = info.device or stage.device
            stage.stats = info.stats
            stage.pid = info.pid or stage.pid
        stage.exit_code = probe.exit_code if probe.exit_code is not None else stage.exit_code
        stage.healthy = verdict is Verdict.SERVING
        stage.misses = 0 if verdict in (Verdict.SERVING, Verdict.STARTING, Verdict.DRAINING) else stage.misses + 1
        stage.error = reason if verdict in (Verdict.FAILED, Verdict.SUSPECT) else None
        if verdict is Verdict.FAILED:
            stage.state = StageState.FAILED
        elif info is not None:
            stage.state = info.state
        elif verdict is Verdict.SERVING:
            stage.state = StageState.SERVING
        if stage.state != previous:
            if stage.state is StageState.SERVING:
                log.info("%s: serving (pid %s, node %s, %s, backend=%s device=%r, quantized=%s, blas=%s, %.1f s)",
                         stage.name, stage.pid, stage.slot.node_id[:8], stage.compute_dtype, stage.backend,
                         stage.device, stage.quantized, stage.blas, self._clock() - stage.started_at)
            elif stage.state is StageState.FAILED:
                self._events.record("stage_lost", f"{stage.name}: {reason or 'failed'}", replica=stage.replica,
                                    rank=stage.rank)
                log.warning("%s: failed: %s", stage.name, reason)
            else:
                log.info("%s: %s", stage.name, stage.state.value)
        elif verdict is Verdict.SUSPECT:
            log.warning("%s: not serving (%s), check %d of %d", stage.name, reason, stage.misses,
                        self.config.unhealthy_after_misses)

    # -- supervision ----------------------------------------------------------

    def _supervise(self, replica: _Replica) -> None:
        interval = self.config.health_interval_s
        while not self._stopping.wait(interval):
            if replica.phase != "serving":
                continue
            try:
                verdicts = self._check(replica, starting=False)
            except Exception as exc:  # a probe must never kill supervision
                log.exception("replica %d: health check failed: %s", replica.index, exc)
                continue
            failed = [(s, reason) for s, (v, reason) in zip(replica.stages, verdicts) if v is Verdict.FAILED]
            if failed:
                # Name the cause, not the neighbours that exited because of it.
                failed.sort(key=lambda f: caused_by_neighbour(f[0].exit_code))
                try:
                    self._restart(replica, *failed[0])
                except _Stopping:
                    return

    def _restart(self, replica: _Replica, stage: _Stage, reason: str | None) -> None:
        """Replace every process of ``replica``; gives up after the restart policy's cap."""
        log.warning("replica %d unhealthy: %s failed (%s); restarting the whole replica\n--- its log:\n%s",
                    replica.index, stage.name, reason, self._log_tail(stage))
        with self._lock:
            replica.phase = "restarting"
            for s in replica.stages:
                s.healthy = False
            self._events.record("replica_restarting", f"{stage.name} failed ({reason}); restarting the whole replica",
                                replica=replica.index, rank=stage.rank)
            self._publish()
        while True:
            self._stop_replica_now(replica)
            delay = self._policy.delay(replica.restart_times, self._clock())
            if delay is None:
                with self._lock:
                    replica.phase = "failed"
                    for s in replica.stages:
                        s.state, s.healthy = StageState.FAILED, False
                        s.error = s.error or f"gave up after {len(replica.restart_times)} restarts"
                    self._events.record("replica_failed", f"gave up after {len(replica.restart_times)} restarts "
                                        f"within {self.config.restart_window_s:.0f} s", replica=replica.index)
                    self._publish()
                log.error("replica %d: giving up after %d restarts within %.0f s; fix the cause "
                          "and restart stagemesh", replica.index, self.config.max_restarts,
                          self.config.restart_window_s)
                return
            if delay and self._stopping.wait(delay):
                raise _Stopping()
            if self._stopping.is_set():
                raise _Stopping()
            with self._lock:
                replica.restart_times.append(self._clock())
                replica.restarts += 1
                self._publish()
            log.info("replica %d: restart %d", replica.index, replica.restarts)
            try:
                if not self._hosts_alive(replica):
                    self._replace_hosts(replica)
                self._plan(replica)
                self._launch(replica)
                self._wait_serving([replica], self.config.startup_timeout_s)
                return
            except _Stopping:
                raise
            except Exception as exc:
                log.error("replica %d: restart %d failed: %s", replica.index, replica.restarts, exc)

    def _stages_on_node(self, node_id: str) -> int:
        return sum(1 for r in self._replicas for s in r.stages if s.slot.node_id == node_id) or 1

    def _stages_on_gpu(self, node_id: str, gpu_index: int | None) -> int:
        if gpu_index is None:
            return 0
        return sum(1 for r in self._replicas for s in r.stages
                   if s.slot.node_id == node_id and s.gpu_index == gpu_index) or 1

    def _hosts_alive(self, replica: _Replica) -> bool:
        try:
            self._describe_hosts(replica, timeout_s=_ACTOR_CALL_S)
            return True
        except Exception as exc:
            log.warning("replica %d: a StageHost is unreachable (%s); placing the replica again",
                        replica.index, type(exc).__name__)
            self._remember_lost_nodes(replica)
            return False

    def _remember_lost_nodes(self, replica: _Replica) -> None:
        """Note the nodes whose StageHost no longer answers, so placing again avoids them."""
        import ray

        for stage in replica.stages:
            try:
                ray.get(stage.actor.describe.remote(), timeout=_ACTOR_CALL_S)
            except Exception:
                self._lost_nodes[stage.slot.node_id] = self._clock()
                self._event("node_lost", f"node {stage.slot.node_id[:8]} lost its StageHost", replica=replica.index,
                            rank=stage.rank)
                log.warning("replica %d stage %d: node %s lost its StageHost; placing elsewhere while "
                            "others have room", replica.index, stage.rank, stage.slot.node_id[:8])

    # -- stopping -------------------------------------------------------------

    def _stop_replica_now(self, replica: _Replica) -> None:
        """A broken replica: SIGTERM every stage at once, SIGKILL after a short grace."""
        import ray

        grace = min(2.0, self.config.stop_grace_s)
        refs = [s.actor.stop.remote(grace) for s in replica.stages]
        for stage, ref in zip(replica.stages, refs):
            try:
                code = ray.get(ref, timeout=grace + _ACTOR_CALL_S)
                log.info("%s: stopped (%s)", stage.name, "not running" if code is None else f"exit {code}")
            except Exception as exc:  # its host is gone; the stage died with it (PDEATHSIG)
                log.warning("%s: could not stop it through its StageHost (%s)", stage.name, type(exc).__name__)
        with self._lock:
            for stage in replica.stages:
                if stage.state is not StageState.FAILED:
                    stage.state = StageState.STOPPED
                stage.healthy, stage.pid = False, None
            self._publish()

    def _stop_replica_orderly(self, replica: _Replica) -> None:
        """SIGTERM the entry stage (it shuts its pipeline down), then the rest, then SIGKILL."""
        import ray

        if not replica.stages:
            return
        grace = self.config.stop_grace_s

        entry = replica.stages[0]
        try:
            ray.get(entry.actor.terminate.remote(), timeout=_ACTOR_CALL_S)
            # The entry exits once its SHUTDOWN has gone round the ring, so by
            # then the others are on their way out too.
            ray.get(entry.actor.wait.remote(grace), timeout=grace + _ACTOR_CALL_S)
        except Exception as exc:
            log.warning("%s: could not signal it (%s)", entry.name, type(exc).__name__)
        refs = [s.actor.stop.remote(grace) for s in replica.stages]
        codes: list[Any] = []
        for ref in refs:
            try:
                codes.append(ray.get(ref, timeout=grace + _ACTOR_CALL_S))
            except Exception as exc:
                codes.append(exc)
        for stage, code in zip(replica.stages, codes):
            if isinstance(code, Exception):
                log.warning("%s: could not stop it through its StageHost (%s)", stage.name, type(code).__name__)
            elif code is not None:
                log.info("%s: stopped (exit %s)", stage.name, code)

    def _release(self, replica: _Replica) -> None:
        import ray

        for stage in replica.stages:
            if stage.channel is not None:
                stage.channel.close()
            try:
                ray.kill(stage.actor)
            except Exception:
                pass
        if replica.group is not None:
            release_bundles(replica.group)

    # -- helpers --------------------------------------------------------------

    def _log_tail(self, stage: _Stage, lines: int = 20) -> str:
        import ray

        try:
            return ray.get(stage.actor.log_tail.remote(lines), timeout=_ACTOR_CALL_S)
        except Exception as exc:
            return f"(log unavailable: {type(exc).__name__})"

    def _event(self, kind: str, message: str, *, replica: int | None = None, rank: int | None = None) -> None:
        """Record an event and publish it at once (takes the lock)."""
        with self._lock:
            self._events.record(kind, message, replica=replica, rank=rank)
            self._publish()

    def _publish(self) -> None:
        """Rebuild the immutable snapshot; caller holds the lock."""
        # Stage start times are kept on the monotonic clock; the snapshot gives them as wall time.
        wall_offset = self._wall_clock() - self._clock()
        replicas = []
        for replica in self._replicas:
            stages = []
            for s in replica.stages:
                p = s.placement
                stages.append(StageSnapshot(
                    rank=s.rank,
                    layers=(p.layers.start, p.layers.end) if p else (0, 0),
                    host=p.host if p else s.slot.address,
                    grpc_port=p.grpc_port if p else 0,
                    ring_port=p.ring_port if p else 0,
                    pid=s.pid, node_id=s.slot.node_id, compute_dtype=s.compute_dtype or self.config.compute_dtype,
                    quantized=s.quantized, healthy=s.healthy, state=s.state, error=s.error, stats=s.stats,
                    blas=s.blas, backend=s.backend, device=s.device,
                    started_at=s.started_at + wall_offset if s.started_at and s.pid else None,
                ))
            replicas.append(ReplicaSnapshot(replica.index, tuple(stages), replica.restarts))
        self._snapshot = MeshSnapshot(self.config.served_model_name, tuple(replicas), self._events.recent())


class _Stopping(Exception):
    """stop() was called while a replica was starting; unwind quietly."""
