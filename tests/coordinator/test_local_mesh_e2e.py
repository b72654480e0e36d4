"""A local mesh (no RAY_ADDRESS) with fake stages: Ray on loopback only, DP x PP lifecycle.

The coordinator starts and stops its own Ray here, so these tests also check
that nothing of Ray listens beyond 127.0.0.1 and that nothing is left behind.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import time

import psutil
import pytest

from coordinator.mesh import MeshConfig, MeshCoordinator, MeshStartError
from coordinator.ray_cluster import connect_ray, disconnect
from coordinator.supervision import BackoffPolicy
from tests.coordinator.conftest import FAKE_STAGE, mesh_ports
from tests.coordinator.helpers import assert_all_released, stage_ports, wait_until

pytestmark = pytest.mark.e2e


@pytest.fixture(autouse=True)
def _no_ray_address(monkeypatch):
    import ray

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert not ray.is_initialized()
    yield
    ray.shutdown()


def _ray_listeners() -> list[tuple[str, str, int]]:
    """(process name, address, port) of every TCP listener of this process's descendants."""
    me = psutil.Process()
    pids = {me.pid} | {p.pid for p in me.children(recursive=True)}
    out = []
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.pid in pids:
            try:
                name = psutil.Process(conn.pid).name()
            except psutil.NoSuchProcess:
                continue
            out.append((name, conn.laddr.ip, conn.laddr.port))
    return out


def _is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def test_local_ray_listens_on_loopback_only_and_goes_away():
    import ray

    session = connect_ray(2)
    try:
        assert session.local and session.owns_connection
        assert session.address.startswith("127.0.0.1:")
        listeners = _ray_listeners()
        assert any(name.startswith("gcs_server") for name, _, _ in listeners), listeners
        assert all(_is_loopback(ip) for _, ip, _ in listeners), listeners
        assert ray.cluster_resources().get("mlx") == 2
    finally:
        disconnect(session)
    assert not ray.is_initialized()
    # Generous: Ray's processes exit in a few seconds, slower while other tests load the cores.
    wait_until(lambda: not _ray_listeners(), 30, "Ray's listeners close")


def _config(pp: int, dp: int, **overrides) -> MeshConfig:
    ring, grpc = mesh_ports(pp * dp)
    return MeshConfig(**{
        "model_path": "/none", "served_model_name": "fake", "num_layers": 30,
        "pipeline_parallel_size": pp, "data_parallel_size": dp, "ring_base_port": ring,
        "grpc_base_port": grpc, "stage_command": FAKE_STAGE, "startup_timeout_s": 60, **overrides})


def test_dp2_pp2_start_restart_one_replica_and_stop():
    import ray

    config = _config(2, 2, max_num_seqs=4)
    coordinator = MeshCoordinator(config)
    started = time.monotonic()
    snapshot = coordinator.start()
    try:
        assert time.monotonic() - started < 60
        assert [r.healthy for r in snapshot.replicas] == [True, True]
        rows = [(r.replica, s.rank, s.layers, s.host, s.grpc_port, s.ring_port, s.state)
                for r in snapshot.replicas for s in r.stages]
        g, ring = config.grpc_base_port, config.ring_base_port
        assert rows == [
            (0, 0, (0, 15), "127.0.0.1", g, ring, "serving"),
            (0, 1, (15, 30), "127.0.0.1", g + 1, ring + 1, "serving"),
            (1, 0, (0, 15), "127.0.0.1", g + 2, ring + 2, "serving"),
            (1, 1, (15, 30), "127.0.0.1", g + 3, ring + 3, "serving"),
        ]
        stage = snapshot.replicas[1].stages[1]
        assert (stage.compute_dtype, stage.quantized, stage.stats.batches) == ("float32", True, 7)
        assert (stage.backend, stage.device) == ("cpu", "fake CPU")
        assert stage.to_json()["node_id"] == ray.get_runtime_context().get_node_id()

        os.kill(stage.pid, signal.SIGKILL)
        wait_until(lambda: not coordinator.snapshot().replicas[1].healthy, 10, "replica 1 unhealthy")
        assert coordinator.snapshot().replicas[0].healthy  # the other replica keeps serving
        wait_until(lambda: coordinator.snapshot().replicas[1].healthy, 30, "replica 1 restarted")
        after = coordinator.snapshot()
        assert [r.restarts for r in after.replicas] == [0, 1]
        assert after.replicas[0].stages[0].pid == snapshot.replicas[0].stages[0].pid
        assert after.replicas[1].stages[1].pid != stage.pid
        # The event journal tells the story with times, in order, naming the replica and stage.
        events = [(e.kind, e.replica, e.rank) for e in after.events]
        assert events[0] == ("mesh_serving", None, None)
        story = [("stage_lost", 1, 1), ("replica_restarting", 1, 1), ("replica_serving", 1, None)]
        assert [e for e in events if e in story] == story, events
        assert all(e[1] in (None, 1) for e in events)  # nothing happened to replica 0
        assert [e.seq for e in after.events] == sorted(e.seq for e in after.events)
        assert all(s.started_at and abs(s.started_at - time.time()) < 120 for r in after.replicas for s in r.stages)
        pids = [s.pid for r in (*snapshot.replicas, *after.replicas) for s in r.stages]
    finally:
        last = coordinator.snapshot()
        coordinator.stop()
    assert_all_released(pids, stage_ports(last, 4, config.ring_base_port))
    assert not ray.is_initialized()  # the local Ray it started is gone
    assert all(not s.healthy and s.state == "stopped" for r in coordinator.snapshot().replicas for s in r.stages)
    assert coordinator.snapshot().events[-1].kind == "mesh_stopped"
    coordinator.stop()  # idempotent


def test_a_stage_failing_at_startup_raises_with_its_log_and_cleans_up():
    import ray

    config = _config(2, 1, stage_command=(*FAKE_STAGE, "--fake-exit-code", "2", "--fake-fail-rank", "1"))
    coordinator = MeshCoordinator(config)
    started = time.monotonic()
    with pytest.raises(MeshStartError) as info:
        coordinator.start()
    assert time.monotonic() - started < 45  # at the stage's exit, not the 60 s startup timeout
    message = str(info.value)
    assert "replica 0 stage 1" in message and f"grpc :{config.grpc_base_port + 1}" in message
    assert "exited with code 2 (configuration error)" in message
    assert "fake stage 1: failing with exit code 2" in message  # the log tail
    assert not ray.is_initialized()
    assert_all_released([], [("127.0.0.1", config.grpc_base_port), ("127.0.0.1", config.ring_base_port)])


def test_a_frozen_stage_is_unhealthy_at_once_and_replaced_after_three_misses():
    config = _config(1, 1, health_timeout_s=0.5, health_interval_s=0.5)
    coordinator = MeshCoordinator(config)
    try:
        frozen = coordinator.start().replicas[0].stages[0]
        os.kill(frozen.pid, signal.SIGSTOP)  # alive, but answers nothing: only health checks can tell
        wait_until(lambda: not coordinator.snapshot().replicas[0].healthy, 10, "frozen stage marked unhealthy")
        assert "DEADLINE_EXCEEDED" in (coordinator.snapshot().replicas[0].stages[0].error or "")
        wait_until(lambda: coordinator.snapshot().replicas[0].restarts == 1, 15, "frozen stage replaced")
        wait_until(lambda: coordinator.snapshot().replicas[0].healthy, 30, "replica serving again")
        pids = [frozen.pid, coordinator.snapshot().replicas[0].stages[0].pid]
    finally:
        last = coordinator.snapshot()
        coordinator.stop()
    assert_all_released(pids, stage_ports(last, 1, config.ring_base_port))


def test_a_replica_that_dies_again_soon_backs_off_and_says_so_then_serves_again():
    config = _config(1, 1, backoff=BackoffPolicy(base_s=3, cap_s=3, stable_after_s=600))
    coordinator = MeshCoordinator(config)
    pids = []
    try:
        pids.append(coordinator.start().replicas[0].stages[0].pid)
        os.kill(pids[-1], signal.SIGKILL)  # the first failure: restarted at once
        wait_until(lambda: coordinator.snapshot().replicas[0].restarts == 1
                   and coordinator.snapshot().replicas[0].healthy, 30, "replica restarted")
        replica = coordinator.snapshot().replicas[0]
        assert (replica.state, replica.consecutive_failures, replica.backoff_s) == ("serving", 1, None)
        pids.append(replica.stages[0].pid)
        os.kill(pids[-1], signal.SIGKILL)  # again, long before it counts as stable: it waits
        wait_until(lambda: coordinator.snapshot().replicas[0].state == "backing_off", 15, "replica backing off")
        backing_off = coordinator.snapshot()
        document = backing_off.to_json()["replicas"][0]
        assert (document["state"], document["consecutive_failures"], document["backoff_s"]) == (
            "backing_off", 2, 3.0)
        event = backing_off.events[-1]
        assert event.kind == "replica_backing_off" and "2 failures in a row; restart 2 in 3 s" in event.message
        assert document["next_restart_at"] == pytest.approx(event.time + 3, abs=0.5)  # Unix time, backoff after it
        assert document["restarts"] == 1 and not document["healthy"]
        wait_until(lambda: coordinator.snapshot().replicas[0].healthy, 30, "replica serving after its backoff")
        after = coordinator.snapshot().replicas[0]
        assert (after.restarts, after.state, after.backoff_s, after.next_restart_at) == (2, "serving", None, None)
        pids.append(after.stages[0].pid)
        kinds = [e.kind for e in coordinator.snapshot().events]
        assert kinds.count("replica_restarting") == 2 and "replica_failed" not in kinds
    finally:
        last = coordinator.snapshot()
        coordinator.stop()
    assert_all_released(pids, stage_ports(last, 1, config.ring_base_port))
