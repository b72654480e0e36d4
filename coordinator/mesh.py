"""MeshCoordinator: bring the mesh up with Ray, keep every replica serving, take it down.

``MeshCoordinator(config)`` offers ``start()``, ``snapshot()`` (the current immutable ``MeshSnapshot``, from
any thread) and ``stop()`` (idempotent; afterwards no stage process runs and no stage port is bound). A start
that fails stops everything and raises ``MeshStartError`` (naming the stage, with its log tail),
``PlacementError`` or ``PlanError``. Once started, each replica is supervised: a failed stage takes its whole
replica down, and the replica starts again after its backoff.

It wires the jobs, each in its own module: ``config`` (``MeshConfig``), ``hosts`` (placement groups,
StageHosts, GPUs, plans), ``launch`` (stage processes), ``checks`` (one health check), ``supervision`` (the
pure rule for what to do next) and ``publish`` (the snapshot and its events). ``stagemesh serve`` drives it.
"""
from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from coordinator.checks import probe_replica, record_verdict
from coordinator.config import MeshConfig, validate_config
from coordinator.health import Verdict, judge
from coordinator.hosts import ACTOR_CALL_S, ReplicaHosts
from coordinator.launch import StageLauncher
from coordinator.layer_planner import MemoryPlan
from coordinator.placement import place_stages
from coordinator.publish import Publisher
from coordinator.ray_cluster import RaySession, cluster_nodes, connect_ray, disconnect, head_address
from coordinator.replica import LiveReplica, LiveStage, ReplicaFailed, Stopping
from coordinator.supervision import (
    GiveUp,
    Nothing,
    Phase,
    Restart,
    WaitUntil,
    backoff_delay,
    failed,
    given_up,
    next_action,
    restarting,
    serving,
    stopped,
)
from stagemesh_core.mesh_token import generate_token
from stagemesh_core.snapshots import MeshSnapshot
from stagemesh_core.states import StageState, caused_by_neighbour

__all__ = ["MeshConfig", "MeshCoordinator", "MeshStartError"]  # MeshConfig: where serve and the tests find it

log = logging.getLogger("stagemesh.coordinator")

_STARTUP_POLL_S = 0.25


class MeshStartError(RuntimeError):
    """The mesh did not come up; the message names the stage and carries its log tail."""


class MeshCoordinator:
    """Runs the mesh described by a ``MeshConfig``.

    Supervision: one thread per replica asks ``supervision.next_action`` and carries it out. While the replica
    serves, it checks its stages every ``health_interval_s``; a failed stage (exited, host gone, FAILED, or not
    serving for ``unhealthy_after_misses`` checks) takes the whole replica down at once (a broken ring cannot be
    repaired in place), and after the backoff (``config.backoff``) the replica starts again with the same plan,
    placed again if its hosts are gone. A replica that has served is restarted forever.
    """

    def __init__(self, config: MeshConfig, *, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        validate_config(config)
        self.config = config
        self.mesh_token = config.mesh_token or generate_token()  # the gateway sends it too
        self._clock = clock
        self._lock = threading.RLock()
        self._stop_lock = threading.Lock()
        self._stopping = threading.Event()
        self._stopped = False
        self._session: RaySession | None = None
        self._replicas: list[LiveReplica] = []
        self._publisher = Publisher(config.served_model_name, config.compute_dtype, config.backoff, clock,
                                    wall_clock)
        self._hosts = ReplicaHosts(config, self.mesh_token, self._replicas, self._lock, clock, self._event)
        self._launcher = StageLauncher(config, self.mesh_token, self._stopping, clock)

    # -- public API -----------------------------------------------------------

    @property
    def memory_plans(self) -> dict[int, MemoryPlan]:
        """Replica -> its layer plan (with the model's facts)."""
        return self._hosts.memory_plans

    def snapshot(self) -> MeshSnapshot:
        return self._publisher.snapshot()

    def start(self) -> MeshSnapshot:
        """Bring every stage up and start supervising; raises ``MeshStartError``, ``PlacementError`` or
        ``PlanError``.

        Joins ``RAY_ADDRESS`` or starts a loopback Ray, places ``P * D`` stages, plans every replica, starts all
        ranks of each replica together and waits until every stage's gRPC health says SERVING. Any failure stops
        everything; a replica that never served is given up, never retried."""
        if self._session is not None or self._stopped:
            raise RuntimeError("MeshCoordinator.start() may be called once")
        cfg = self.config
        started = self._clock()
        atexit.register(self.stop)
        try:
            self._session = connect_ray(cfg.total_workers, address=cfg.ray_address)
            nodes = cluster_nodes(self._session.driver_node_id)
            placement = place_stages(nodes, cfg.pipeline_parallel_size, cfg.data_parallel_size,
                                     local=self._session.local, head_address=head_address(nodes),
                                     tensor_parallel_size=cfg.tensor_parallel_size)
            for index, slots in enumerate(placement.replicas):
                self._replicas.append(self._hosts.reserve(index, slots))
            for replica in self._replicas:
                self._hosts.describe(replica)
                with self._lock:
                    self._hosts.assign_gpus(replica)  # all replicas' first: the layer plan counts each GPU's sharers
            for replica in self._replicas:
                self._hosts.plan(replica)
            with self._lock:
                self._publish()
            for replica in self._replicas:
                self._launch(replica)
            self._wait_serving(self._replicas, cfg.startup_timeout_s)
        except ReplicaFailed as exc:
            try:
                self._give_up_at_start(exc)
            finally:
                self.stop()
            raise MeshStartError(str(exc)) from None
        except BaseException:
            self.stop()
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
        """Stop every stage, the actors, the placement groups and a Ray we started. Idempotent.

        The entry stage of each replica gets SIGTERM first (it stops its pipeline cleanly), then the rest;
        stragglers get SIGKILL. Afterwards no stage process runs and no stage port is bound."""
        with self._stop_lock:
            if self._stopped:
                return
            self._stopping.set()
            began = self._clock()
            for replica in self._replicas:
                if replica.thread is not None and replica.thread is not threading.current_thread():
                    # It notices stop() within one actor call and a stop's grace.
                    replica.thread.join(timeout=ACTOR_CALL_S + self.config.stop_grace_s + 5)
            with ThreadPoolExecutor(max_workers=max(1, len(self._replicas))) as pool:
                list(pool.map(self._launcher.stop_orderly, self._replicas))
            for replica in self._replicas:
                self._launcher.release(replica)
            disconnect(self._session)
            with self._lock:
                for replica in self._replicas:
                    replica.record = stopped(replica.record, self._clock())
                    for stage in replica.stages:
                        stage.state, stage.healthy, stage.pid = StageState.STOPPED, False, None
                if self._replicas:
                    self._publisher.record("mesh_stopped", "every stage stopped")
                self._publish()
            self._stopped = True
            atexit.unregister(self.stop)
            if self._replicas:
                log.info("mesh stopped in %.1f s", self._clock() - began)

    # -- starting -------------------------------------------------------------

    def _launch(self, replica: LiveReplica) -> None:
        pids = self._launcher.start(replica, self._hosts.options(replica))
        now = self._clock()
        with self._lock:
            for stage, pid in zip(replica.stages, pids):
                stage.pid, stage.state, stage.healthy, stage.error = pid, StageState.STARTING, False, None
                stage.exit_code = None
                stage.misses, stage.started_at = 0, now
            self._publish()

    def _wait_serving(self, replicas: Sequence[LiveReplica], timeout_s: float) -> None:
        """Until every stage of ``replicas`` serves; raises ``ReplicaFailed`` on the first failure."""
        deadline = self._clock() + timeout_s
        while True:
            pending = [r for r in replicas if r.record.phase is Phase.STARTING]
            if not pending:
                return
            for replica in pending:
                verdicts = self._check(replica, starting=True)
                for stage, (verdict, reason) in zip(replica.stages, verdicts):
                    if verdict is Verdict.FAILED:
                        raise ReplicaFailed(stage, reason or "failed", self._launcher.log_tail(stage))
                if all(v is Verdict.SERVING for v, _ in verdicts):
                    with self._lock:
                        replica.record = serving(replica.record, self._clock())
                        if replica.record.restarts:
                            self._publisher.record("replica_serving", "serving again after restart "
                                                   f"{replica.record.restarts}", replica=replica.index)
                        self._publish()
                    log.info("replica %d: serving (%d stage(s), %.1f s)", replica.index, len(replica.stages),
                             self._clock() - replica.stages[0].started_at)
            if self._clock() > deadline:
                late = [s for r in replicas for s in r.stages if not s.healthy]
                stage = late[0] if late else replicas[0].stages[0]
                raise ReplicaFailed(
                    stage, f"not serving after {timeout_s:.0f} s (state {stage.state.value}); raise the startup "
                    f"timeout for big models", self._launcher.log_tail(stage))
            if self._stopping.wait(_STARTUP_POLL_S):
                raise Stopping()

    def _give_up_at_start(self, exc: ReplicaFailed) -> None:
        """A replica failed before it ever served: supervision gives it up (so the mesh does not start)."""
        replica = self._replicas[exc.stage.replica]
        now = self._clock()
        with self._lock:
            replica.record = failed(replica.record, now, f"{exc.stage.name} failed ({exc.reason})",
                                    self.config.backoff, exc.stage.rank)
            action = next_action(replica.record, now, self.config.backoff)
        assert isinstance(action, GiveUp), action  # a replica that never served is never retried
        self._give_up(replica, action.reason)

    # -- checking -------------------------------------------------------------

    def _check(self, replica: LiveReplica, *, starting: bool) -> list[tuple[Verdict, str | None]]:
        """Probe, judge and record every stage of ``replica``; publishes a new snapshot."""
        probes = probe_replica(replica, self.config.health_timeout_s)
        max_misses = self.config.unhealthy_after_misses
        verdicts = []
        with self._lock:
            for stage, probe in zip(replica.stages, probes):
                verdict, reason = judge(probe, starting=starting, misses=stage.misses, max_misses=max_misses)
                record_verdict(stage, probe, verdict, reason, max_misses=max_misses,
                               seconds_running=self._clock() - stage.started_at, on_event=self._publisher.record)
                verdicts.append((verdict, reason))
            self._publish()
        return verdicts

    # -- supervision ----------------------------------------------------------

    def _supervise(self, replica: LiveReplica) -> None:
        """Carry out ``supervision.next_action`` for ``replica`` until the mesh stops."""
        while not self._stopping.is_set():
            with self._lock:
                action = next_action(replica.record, self._clock(), self.config.backoff)
            try:
                match action:
                    case Nothing():
                        if self._stopping.wait(self.config.health_interval_s):
                            return
                        self._watch(replica)
                    case WaitUntil(at=at):
                        if self._stopping.wait(max(0.0, at - self._clock())):
                            return
                    case Restart(attempt=attempt):
                        self._restart(replica, attempt)
                    case GiveUp(reason=reason):
                        self._give_up(replica, reason)
                        return
            except Stopping:
                return
            except Exception as exc:  # one step going wrong must not end the replica's supervision
                log.exception("replica %d: supervision step %s failed: %s", replica.index, action, exc)
                with self._lock:
                    if replica.record.phase is Phase.STARTING:  # a restart that ended neither serving nor down
                        replica.record = failed(replica.record, self._clock(), f"restart failed: {exc}",
                                                self.config.backoff)
                        self._publish()
                if self._stopping.wait(self.config.health_interval_s):
                    return

    def _watch(self, replica: LiveReplica) -> None:
        """One health check of a serving replica; a failed stage takes the replica down."""
        if replica.record.phase is not Phase.SERVING:
            return
        try:
            verdicts = self._check(replica, starting=False)
        except Exception as exc:  # a probe must never kill supervision
            log.exception("replica %d: health check failed: %s", replica.index, exc)
            return
        lost = [(s, reason) for s, (v, reason) in zip(replica.stages, verdicts) if v is Verdict.FAILED]
        if lost:
            # Name the cause, not the neighbours that exited because of it.
            lost.sort(key=lambda f: caused_by_neighbour(f[0].exit_code))
            stage, reason = lost[0]
            self._take_down(replica, stage, reason or "failed")

    def _take_down(self, replica: LiveReplica, stage: LiveStage | None, reason: str) -> None:
        """Stop every process of ``replica`` at once and record the failure; its restart waits its backoff."""
        cause = f"{stage.name} failed ({reason})" if stage is not None else reason
        tail = f"\n--- its log:\n{self._launcher.log_tail(stage)}" if stage is not None else ""
        log.warning("replica %d down: %s; stopping the whole replica%s", replica.index, cause, tail)
        with self._lock:
            for s in replica.stages:
                s.healthy = False
            self._publish()
        self._launcher.stop_now(replica)
        policy = self.config.backoff
        now = self._clock()
        with self._lock:
            for s in replica.stages:
                if s.state is not StageState.FAILED:
                    s.state = StageState.STOPPED
                s.healthy, s.pid = False, None
            replica.record = record = failed(replica.record, now, cause, policy,
                                             stage.rank if stage is not None else None)
            action = next_action(record, now, policy)
            if isinstance(action, WaitUntil):
                delay = backoff_delay(record.failures, policy)
                self._publisher.record(
                    "replica_backing_off", f"{record.failures} failures in a row; restart {record.restarts + 1} "
                    f"in {delay:.0f} s", replica=replica.index)
                log.warning("replica %d: %d failures in a row; restart %d in %.0f s", replica.index,
                            record.failures, record.restarts + 1, delay)
            self._publish()

    def _restart(self, replica: LiveReplica, attempt: int) -> None:
        """Start every process of ``replica`` again (placed again if its hosts are gone) and wait until it serves."""
        with self._lock:
            cause = replica.record
            replica.record = restarting(replica.record, self._clock())
            self._publisher.record("replica_restarting", f"{cause.reason}; restarting the whole replica",
                                   replica=replica.index, rank=cause.failed_rank)
            self._publish()
        log.info("replica %d: restart %d", replica.index, attempt)
        try:
            if not self._hosts.alive(replica):
                self._hosts.place_again(replica, self._session)
            self._hosts.plan(replica)
            self._launch(replica)
            self._wait_serving([replica], self.config.startup_timeout_s)
        except Stopping:
            raise
        except ReplicaFailed as exc:
            self._take_down(replica, exc.stage, exc.reason)
        except Exception as exc:
            log.error("replica %d: restart %d failed: %s", replica.index, attempt, exc)
            self._take_down(replica, None, f"restart {attempt} failed: {exc}")

    def _give_up(self, replica: LiveReplica, reason: str) -> None:
        with self._lock:
            replica.record = given_up(replica.record, self._clock())
            self._publisher.record("replica_failed", f"never served, so it is not restarted: {reason}",
                                   replica=replica.index)
            self._publish()
        log.error("replica %d: it never served, so restarting will not help; fix the cause: %s", replica.index,
                  reason)

    # -- publishing -----------------------------------------------------------

    def _event(self, kind: str, message: str, *, replica: int | None = None, rank: int | None = None) -> None:
        """Record an event and publish it at once (takes the lock)."""
        with self._lock:
            self._publisher.record(kind, message, replica=replica, rank=rank)
            self._publish()

    def _publish(self) -> None:
        """Rebuild the immutable snapshot; the caller holds the lock."""
        self._publisher.publish(self._replicas)
