"""Start and stop a replica's stage processes through their StageHosts.

``StageLauncher`` (one per mesh) offers ``start(replica, options)`` (all ranks together once their ports are
free; their pids), ``stop_now`` (a broken replica), ``stop_orderly`` (entry stage first),
``release`` (channels, actors, placement group) and ``log_tail(stage)`` for error messages.

It changes no live record: the caller (``coordinator.mesh``) records pids and states under its lock.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from coordinator.config import MeshConfig
from coordinator.hosts import ACTOR_CALL_S
from coordinator.placement import PlacementError
from coordinator.ray_cluster import release_bundles
from coordinator.replica import LiveReplica, LiveStage, Stopping
from stagemesh_core.plan import StageLaunch, StageOptions

log = logging.getLogger("stagemesh.coordinator")

PORTS_FREE_S = 30.0


class StageLauncher:
    def __init__(self, config: MeshConfig, mesh_token: str, stopping: threading.Event,
                 clock: Callable[[], float]) -> None:
        self.config = config
        self._mesh_token = mesh_token
        self._stopping = stopping
        self._clock = clock

    def start(self, replica: LiveReplica, options: Sequence[StageOptions]) -> list[int]:
        """Start every rank of ``replica`` at once, once their ports are free; their pids.

        All ranks start together because the ring needs all of them (each waits for its neighbours). Ports
        still busy after ``PORTS_FREE_S`` raise ``PlacementError`` naming them; the mesh's ``stop()`` while
        this waits raises ``Stopping``."""
        import ray

        plan = replica.plan
        assert plan is not None
        deadline = self._clock() + PORTS_FREE_S
        while any(busy := self._busy_ports(replica)):
            if self._clock() > deadline:
                taken = "; ".join(f"{p.host}: {ports}" for p, ports in zip(plan.workers, busy) if ports)
                raise PlacementError(
                    f"replica {replica.index}: ports still in use after {PORTS_FREE_S:.0f} s ({taken}); "
                    f"stop whatever holds them or choose other --ring-base-port / --grpc-base-port")
            if self._stopping.wait(0.25):
                raise Stopping()
        for stage, p in zip(replica.stages, plan.workers):
            gpu = f", GPU {stage.gpu_index}" if stage.gpu_index is not None else ""
            log.info("%s: loading layers %s (node %s%s)", stage.name, p.layers, stage.slot.node_id[:8], gpu)
        tls_dir = self.config.grpc_tls.directory if self.config.grpc_tls else ""
        return ray.get([
            s.actor.start.remote(
                StageLaunch(plan, s.rank, opts, mesh_token=self._mesh_token, grpc_tls_dir=tls_dir,
                            member=s.member).to_json(),
                self.config.stage_command)
            for s, opts in zip(replica.stages, options)
        ], timeout=ACTOR_CALL_S)

    def _busy_ports(self, replica: LiveReplica) -> list[list[int]]:
        import ray

        assert replica.plan is not None
        return ray.get([
            s.actor.busy_ports.remote(p.host, p.ports)
            for s, p in zip(replica.stages, replica.plan.workers)
        ], timeout=ACTOR_CALL_S)

    def stop_now(self, replica: LiveReplica) -> None:
        """A broken replica: SIGTERM every stage at once, SIGKILL after a short grace."""
        import ray

        grace = min(2.0, self.config.stop_grace_s)
        refs = [s.actor.stop.remote(grace) for s in replica.stages]
        for stage, ref in zip(replica.stages, refs):
            try:
                code = ray.get(ref, timeout=grace + ACTOR_CALL_S)
                log.info("%s: stopped (%s)", stage.name, "not running" if code is None else f"exit {code}")
            except Exception as exc:  # its host is gone; the stage died with it (PDEATHSIG)
                log.warning("%s: could not stop it through its StageHost (%s)", stage.name, type(exc).__name__)

    def stop_orderly(self, replica: LiveReplica) -> None:
        """SIGTERM the entry stage (it shuts its pipeline down), then the rest, then SIGKILL stragglers."""
        import ray

        if not replica.stages:
            return
        grace = self.config.stop_grace_s

        entry = replica.stages[0]
        try:
            ray.get(entry.actor.terminate.remote(), timeout=ACTOR_CALL_S)
            # The entry exits once its SHUTDOWN has gone round the ring, so by
            # then the others are on their way out too.
            ray.get(entry.actor.wait.remote(grace), timeout=grace + ACTOR_CALL_S)
        except Exception as exc:
            log.warning("%s: could not signal it (%s)", entry.name, type(exc).__name__)
        refs = [s.actor.stop.remote(grace) for s in replica.stages]
        codes: list[Any] = []
        for ref in refs:
            try:
                codes.append(ray.get(ref, timeout=grace + ACTOR_CALL_S))
            except Exception as exc:
                codes.append(exc)
        for stage, code in zip(replica.stages, codes):
            if isinstance(code, Exception):
                log.warning("%s: could not stop it through its StageHost (%s)", stage.name, type(code).__name__)
            elif code is not None:
                log.info("%s: stopped (exit %s)", stage.name, code)

    def release(self, replica: LiveReplica) -> None:
        """Close ``replica``'s channels, kill its actors and remove its placement group."""
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

    def log_tail(self, stage: LiveStage, lines: int = 20) -> str:
        """The end of ``stage``'s log, for error messages."""
        import ray

        try:
            return ray.get(stage.actor.log_tail.remote(lines), timeout=ACTOR_CALL_S)
        except Exception as exc:
            return f"(log unavailable: {type(exc).__name__})"
