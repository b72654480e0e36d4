"""Assertions and a loopback Ray cluster shared by the coordinator's Ray tests."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import psutil

from coordinator.ray_cluster import NO_PRESTART_ENV, is_startup_timeout, loopback_only
from coordinator.stage_host import busy_ports
from stagemesh_core.snapshots import MeshSnapshot


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



@contextlib.contextmanager
def added_environment(env: Mapping[str, str]) -> Iterator[None]:
    """``env`` in this process's environment (so in what it starts) for the block, the old values back after."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def loopback_cluster(node_envs: Sequence[Mapping[str, str]], attempts: int = 2) -> tuple[Any, list[Any]]:
    """A ``ray.cluster_utils.Cluster`` on loopback with one ``mlx`` unit and one CPU per node, each node started
    with ``node_envs[i]`` added to the environment (its raylet, workers and stages inherit it; the first node is
    the head), and the driver connected to it. Returns the cluster and its nodes in order.

    Ray gives a node 30 s to register, which a loaded 2-core machine running other e2e groups can pass: a
    cluster that timed out so is shut down and started again, as ``coordinator.ray_cluster`` does for a mesh."""
    import ray
    from ray.cluster_utils import Cluster

    assert not ray.is_initialized()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault(NO_PRESTART_ENV, "0")  # as a mesh's own Ray: actors only, no idle task workers
    node = dict(node_ip_address="127.0.0.1", resources={"mlx": 1}, num_cpus=1)
    head = {**node, "include_dashboard": False}
    for attempt in range(1, attempts + 1):
        cluster = Cluster(initialize_head=False)
        try:
            with loopback_only():
                nodes = []
                for env in node_envs:
                    with added_environment(env):
                        nodes.append(cluster.add_node(**(node if nodes else head)))
                ray.init(address=cluster.address, log_to_driver=False)
            return cluster, nodes
        except Exception as exc:  # Ray raises a bare Exception for a node's registration timeout
            cluster.shutdown()
            if attempt == attempts or not is_startup_timeout(exc):
                raise
    raise AssertionError(f"attempts must be at least 1, not {attempts}")
