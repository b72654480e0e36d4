"""Assertions shared by the coordinator's Ray tests."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import psutil

from coordinator.stage_host import busy_ports
from stagemesh.core.snapshots import MeshSnapshot


def running(pid: int | None) -> bool:
    """True while ``pid`` is a live (non-zombie) process."""
    if pid is None:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.05) -> float:
    """Seconds until ``predicate()`` held; fails the test after ``timeout_s``."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        time.sleep(poll_s)
    return time.monotonic() - started


def stage_ports(snapshot: MeshSnapshot, total_stages: int, ring_base: int) -> list[tuple[str, int]]:
    """Every (host, port) a stage of ``snapshot`` binds: ring, control lane, gRPC."""
    out = []
    for replica in snapshot.replicas:
        for stage in replica.stages:
            g = stage.ring_port - ring_base
            out += [(stage.host, stage.ring_port), (stage.host, ring_base + total_stages + g),
                    (stage.host, stage.grpc_port)]
    return out


def assert_all_released(pids: Iterable[int | None], ports: Iterable[tuple[str, int]]) -> None:
    alive = [pid for pid in pids if running(pid)]
    assert not alive, f"stage processes still running: {alive}"
    bound = [(h, p) for h, p in ports if busy_ports(h, [p])]
    assert not bound, f"ports still bound: {bound}"
