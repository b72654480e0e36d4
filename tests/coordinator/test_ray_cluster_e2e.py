"""StageHost placement and MeshCoordinator over a simulated 3-node Ray cluster on loopback.

``ray.cluster_utils.Cluster`` runs three raylets on this machine, each with one
``mlx`` unit; the third node starts with ``STAGEMESH_HOST_IP=127.0.0.2`` in its
environment (as a launchd plist would set it on a real Mac). Stages are the
fake stage (no model), so the whole module takes well under a minute.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import psutil
import pytest

from coordinator.mesh import MeshConfig, MeshCoordinator
from coordinator.placement import PlacementError, place_stages
from coordinator.ray_cluster import cluster_nodes, loopback_only, release_bundles, reserve_bundles
from coordinator.stage_host import stage_host_actor
from tests.coordinator.conftest import FAKE_STAGE, mesh_ports
from tests.coordinator.helpers import assert_all_released, loopback_cluster, running, stage_ports, wait_until

pytestmark = pytest.mark.e2e

PINNED = "127.0.0.2"
SLEEPER = ("-c", "import time; time.sleep(60)")


@pytest.fixture(scope="module")
def cluster():
    import ray

    # The third node's raylet, and so its workers, inherit the pinned address.
    c, _ = loopback_cluster([{}, {}, {"STAGEMESH_HOST_IP": PINNED}])
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def _outward_addresses() -> set[str]:
    return {a.address for addrs in psutil.net_if_addrs().values() for a in addrs
            if a.family.name == "AF_INET" and not a.address.startswith("127.")}


def _driver_node() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def test_stage_hosts_land_on_their_nodes_and_advertise_the_right_address(cluster):
    import ray

    nodes = cluster_nodes(_driver_node())
    assert sorted(n.mlx_units for n in nodes) == [1, 1, 1]
    assert {n.address for n in nodes} == {"127.0.0.1"}
    placement = place_stages(nodes, 3, 1)
    assert placement.slots[0].node_id == _driver_node()  # the entry stage sits with the gateway
    assert placement.is_spread(0)
    group = reserve_bundles(placement.slots, timeout_s=20)
    actors = [stage_host_actor(group, i, f"t{i}") for i in range(3)]
    try:
        infos = ray.get([a.describe.remote() for a in actors], timeout=60)
        assert [i.node_id for i in infos] == [s.node_id for s in placement.slots]
        hosts = {i.host for i in infos}
        assert hosts == {"127.0.0.1", PINNED}
        assert [i.host_source for i in infos].count("STAGEMESH_HOST_IP") == 1
        assert not hosts & _outward_addresses()  # never the interface get_node_ip_address() would guess
        assert all(i.python and i.stagemesh for i in infos)
    finally:
        for a in actors:
            ray.kill(a)
        release_bundles(group)


def test_a_killed_actor_takes_its_stage_process_along(cluster):
    import ray

    placement = place_stages(cluster_nodes(_driver_node()), 1, 1)
    group = reserve_bundles(placement.slots, timeout_s=20)
    actor = stage_host_actor(group, 0, "doomed")
    try:
        pid = ray.get(actor.start.remote("{}", SLEEPER), timeout=60)
        assert running(pid)
        ray.kill(actor)
        wait_until(lambda: not running(pid), 30, "stage process dies with its StageHost")
    finally:
        release_bundles(group)


def test_too_few_units_is_refused_at_once_with_the_fix(cluster):
    ring, grpc = mesh_ports(4)
    coordinator = MeshCoordinator(MeshConfig(
        model_path="/none", served_model_name="fake", num_layers=30, pipeline_parallel_size=2,
        data_parallel_size=2, ring_base_port=ring, grpc_base_port=grpc, stage_command=FAKE_STAGE))
    started = time.monotonic()
    with pytest.raises(PlacementError) as info:
        coordinator.start()
    assert time.monotonic() - started < 15  # refused up front, not after a placement timeout
    message = str(info.value)
    assert "needs 4 'mlx' units" in message and "the Ray cluster has 3" in message
    assert "ray start --address=127.0.0.1:6379 --resources='{\"mlx\": 1}'" in message
    coordinator.stop()  # idempotent after a failed start


def test_units_held_elsewhere_time_out_with_a_clear_error(cluster):
    placement = place_stages(cluster_nodes(_driver_node()), 3, 1)
    hog = reserve_bundles(placement.slots, timeout_s=20)
    try:
        started = time.monotonic()
        with pytest.raises(PlacementError, match=r"could not reserve 1 'mlx' unit\(s\) within 3 s"):
            reserve_bundles(placement.slots[:1], timeout_s=3)
        assert time.monotonic() - started < 15  # the 3 s asked for, not Ray's pending forever
    finally:
        release_bundles(hog)


def test_mesh_spreads_a_pipeline_over_three_nodes_and_recovers(cluster):
    ring, grpc = mesh_ports(3)
    coordinator = MeshCoordinator(MeshConfig(
        model_path="/none", served_model_name="fake", num_layers=30, pipeline_parallel_size=3,
        ring_base_port=ring, grpc_base_port=grpc, stage_command=FAKE_STAGE, startup_timeout_s=60))
    try:
        snapshot = coordinator.start()
        (replica,) = snapshot.replicas
        assert replica.healthy
        assert len({s.node_id for s in replica.stages}) == 3
        assert replica.stages[0].node_id == _driver_node()
        assert sorted(s.host for s in replica.stages) == ["127.0.0.1", "127.0.0.1", PINNED]
        assert [s.grpc_port for s in replica.stages] == [grpc, grpc + 1, grpc + 2]
        victim = next(s for s in replica.stages if s.host == PINNED)
        os.kill(victim.pid, signal.SIGKILL)
        wait_until(lambda: not coordinator.snapshot().replicas[0].healthy, 10, "replica marked unhealthy")
        wait_until(lambda: coordinator.snapshot().replicas[0].healthy, 30, "replica restarted")
        again = coordinator.snapshot().replicas[0]
        assert again.restarts == 1
        assert [s.node_id for s in again.stages] == [s.node_id for s in replica.stages]
        pids = [s.pid for s in replica.stages] + [s.pid for s in again.stages]
    finally:
        before_stop = coordinator.snapshot()
        coordinator.stop()
    assert_all_released(pids, stage_ports(before_stop, 3, ring))
    import ray

    assert ray.is_initialized()  # the cluster was not ours to shut down


def test_a_replica_whose_node_leaves_is_placed_again_on_a_new_node(cluster):
    """Last in this module: it removes a node from the shared cluster."""
    ring, grpc = mesh_ports(2)
    coordinator = MeshCoordinator(MeshConfig(
        model_path="/none", served_model_name="fake", num_layers=30, pipeline_parallel_size=2,
        ring_base_port=ring, grpc_base_port=grpc, stage_command=FAKE_STAGE, startup_timeout_s=60))
    try:
        before = coordinator.start().replicas[0]
        lost = before.stages[1].node_id
        node = next(n for n in cluster.worker_nodes if n.node_id == lost)
        with loopback_only():
            cluster.remove_node(node)
            # A node that leaves takes its processes with it. Ray's simulated node only stops its
            # raylet; its worker (and so the stage under it) can linger for many seconds while
            # holding the stage's ports on this one shared host, which no real departure does.
            with contextlib.suppress(ProcessLookupError):
                os.kill(before.stages[1].pid, signal.SIGKILL)
            replacement = cluster.add_node(node_ip_address="127.0.0.1", resources={"mlx": 1}, num_cpus=1)
        wait_until(lambda: not coordinator.snapshot().replicas[0].healthy, 15, "replica marked unhealthy")
        wait_until(lambda: coordinator.snapshot().replicas[0].healthy, 60, "replica placed again")
        after = coordinator.snapshot().replicas[0]
        assert after.stages[0].node_id == before.stages[0].node_id
        assert after.stages[1].node_id != lost
        assert after.stages[1].node_id in {replacement.node_id} | {n.node_id for n in cluster.worker_nodes}
        assert after.restarts >= 1
        kinds = [e.kind for e in coordinator.snapshot().events]
        assert {"stage_lost", "node_lost", "replica_replaced", "replica_serving"} <= set(kinds), kinds
        # The node is noticed gone, the replica placed again, and then it serves.
        last_serving = max(i for i, kind in enumerate(kinds) if kind == "replica_serving")
        assert kinds.index("node_lost") < kinds.index("replica_replaced") < last_serving
        pids = [s.pid for s in (*before.stages, *after.stages)]
    finally:
        last = coordinator.snapshot()
        coordinator.stop()
    assert_all_released(pids, stage_ports(last, 2, ring))
