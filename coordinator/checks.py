"""One health check of a replica: probe its stages in parallel, then write each verdict into its live record.

- ``probe_replica(replica, timeout_s)``: for every stage at once, its
  StageHost's ``poll`` (exit code, or the host gone) and the two gRPC probes
  (``health.StageChannel``); one ``StageProbe`` per stage.
- ``record_verdict(stage, probe, verdict, reason, ...)``: update the live
  stage (state, health, pid, what it reports, the count of misses), log each
  change of state, and journal ``stage_lost`` when it fails. The caller holds
  the coordinator's lock and judges the probe first (``health.judge``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from coordinator.health import StageChannel, StageProbe, Verdict
from coordinator.replica import LiveReplica, LiveStage
from stagemesh_core.snapshots import StageStats
from stagemesh_core.states import StageState

log = logging.getLogger("stagemesh.coordinator")

EventSink = Callable[..., None]  # (kind, message, *, replica=None, rank=None)


def probe_replica(replica: LiveReplica, timeout_s: float) -> list[StageProbe]:
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    polls = [s.actor.poll.remote() for s in replica.stages]
    rpcs = [s.channel.start_probe(timeout_s) if s.channel else None for s in replica.stages]
    ray.wait(polls, num_returns=len(polls), timeout=max(timeout_s, 2.0))
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


def record_verdict(stage: LiveStage, probe: StageProbe, verdict: Verdict, reason: str | None, *,
                   max_misses: int, seconds_running: float, on_event: EventSink) -> None:
    previous = stage.state
    info = probe.info
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
                     stage.device, stage.quantized, stage.blas, seconds_running)
        elif stage.state is StageState.FAILED:
            on_event("stage_lost", f"{stage.name}: {reason or 'failed'}", replica=stage.replica, rank=stage.rank)
            log.warning("%s: failed: %s", stage.name, reason)
        else:
            log.info("%s: %s", stage.name, stage.state.value)
    elif verdict is Verdict.SUSPECT:
        log.warning("%s: not serving (%s), check %d of %d", stage.name, reason, stage.misses, max_misses)
    if stage.state is StageState.LOADING and (tenth := loaded_tenths(stage.stats)) > stage.load_tenths_logged:
        # The serve log shows each stage's weights arriving, a line per tenth (a large model loads for minutes).
        stage.load_tenths_logged = tenth
        log.info("%s: loading, %d%% of %.1f GB read", stage.name, 10 * tenth, stage.stats.load_total_bytes / 1e9)


def loaded_tenths(stats: StageStats) -> int:
    """How many whole tenths of its weights a loading stage has read (0 before it knows its total)."""
    if not stats.load_total_bytes:
        return 0
    return min(10, 10 * stats.load_done_bytes // stats.load_total_bytes)
