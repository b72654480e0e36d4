"""Placement decisions over made-up clusters (no Ray)."""

from __future__ import annotations

import pytest

from coordinator.placement import (
    ClusterNode,
    PlacementError,
    check_port_ranges,
    pipeline_plan,
    pipeline_plans,
    place_stages,
    without_lost_nodes,
)


def _nodes(*spec: tuple[str, int, bool]) -> list[ClusterNode]:
    return [ClusterNode(name, f"10.0.0.{i + 1}", units, head) for i, (name, units, head) in enumerate(spec)]


def _layout(placement) -> list[list[str]]:
    return [[s.node_id for s in replica] for replica in placement.replicas]


@pytest.mark.parametrize(
    ("spec", "pp", "dp", "expected"),
    [
        pytest.param([("A", 1, True)], 1, 1, [["A"]], id="one-mac"),
        pytest.param([("A", 1, True), ("B", 1, False)], 2, 1, [["A", "B"]], id="two-macs-pp2"),
        pytest.param([("B", 1, False), ("A", 1, True)], 2, 1, [["A", "B"]], id="head-listed-last"),
        pytest.param([("A", 1, True), ("B", 1, False)], 1, 2, [["A"], ["B"]], id="two-macs-dp2"),
        pytest.param([("A", 4, True)], 2, 2, [["A", "A"], ["A", "A"]], id="local-all-on-one"),
        pytest.param([("A", 2, True), ("B", 2, False)], 2, 2, [["A", "B"], ["A", "B"]], id="2x2-spread"),
        pytest.param(
            [("A", 1, True), ("B", 2, False), ("C", 2, False)], 2, 2, [["A", "B"], ["C", "B"]],
            id="head-once-then-fullest",
        ),
        pytest.param(
            [("A", 3, True), ("B", 1, False), ("C", 1, False)], 3, 1, [["A", "B", "C"]],
            id="spread-beats-fullest",
        ),
        pytest.param([("A", 3, True), ("B", 1, False)], 3, 1, [["A", "B", "A"]], id="fallback-shares-node"),
        pytest.param([("A", 0, True), ("B", 1, False), ("C", 1, False)], 2, 1, [["B", "C"]], id="head-without-mlx"),
    ],
)
def test_layouts(spec, pp, dp, expected):
    placement = place_stages(_nodes(*spec), pp, dp)
    assert _layout(placement) == expected
    assert [(s.replica, s.rank) for s in placement.slots] == [(r, k) for r in range(dp) for k in range(pp)]


def test_slots_carry_node_addresses_and_spread_flag():
    placement = place_stages(_nodes(("A", 1, True), ("B", 1, False)), 2, 1)
    assert [s.address for s in placement.slots] == ["10.0.0.1", "10.0.0.2"]
    assert placement.is_spread(0)
    assert not place_stages(_nodes(("A", 2, True)), 2, 1).is_spread(0)


def test_not_enough_units_says_how_many_and_how_to_add():
    nodes = _nodes(("A", 1, True), ("B", 1, False))
    with pytest.raises(PlacementError) as info:
        place_stages(nodes, 3, 1, head_address="192.168.50.1")
    message = str(info.value)
    assert "needs 3 'mlx' units" in message
    assert "the Ray cluster has 2 (10.0.0.1 x1, 10.0.0.2 x1)" in message
    assert "ray start --address=192.168.50.1:6379 --resources='{\"mlx\": 1}'" in message
    assert "STAGEMESH_HOST_IP" in message


def test_not_enough_units_local_names_the_flags():
    with pytest.raises(PlacementError, match=r"--pipeline-parallel-size x --data-parallel-size at or below 2"):
        place_stages(_nodes(("A", 2, True)), 3, 1, local=True)


def test_placeholder_head_address_when_unknown():
    with pytest.raises(PlacementError, match=r"ray start --address=HEAD_IP:6379"):
        place_stages([], 1, 1)


@pytest.mark.parametrize(("pp", "dp", "flag"), [(0, 1, "--pipeline-parallel-size"), (1, 0, "--data-parallel-size")])
def test_sizes_must_be_positive(pp, dp, flag):
    with pytest.raises(PlacementError, match=flag):
        place_stages(_nodes(("A", 4, True)), pp, dp)


def test_pipeline_plan_ports_follow_global_index():
    plan = pipeline_plan(
        1, ["10.0.0.1", "10.0.0.2"], data_parallel_size=2, model_path="/m", num_layers=30,
        compute_dtype="float32", ring_base_port=32323, grpc_base_port=50051,
    )
    assert plan.replica == 1
    assert [(s.rank, s.global_index) for s in plan.stages] == [(0, 2), (1, 3)]
    assert [(s.layers.start, s.layers.end) for s in plan.stages] == [(0, 15), (15, 30)]
    assert [s.host for s in plan.stages] == ["10.0.0.1", "10.0.0.2"]
    assert [s.ring_port for s in plan.stages] == [32325, 32326]
    assert [s.lane_port for s in plan.stages] == [32329, 32330]  # ring_base + total(4) + g
    assert [s.grpc_port for s in plan.stages] == [50053, 50054]
    assert plan.ring_hostfile() == [["10.0.0.1:32325"], ["10.0.0.2:32326"]]


def test_pipeline_plans_use_advertised_hosts():
    placement = place_stages(_nodes(("A", 1, True), ("B", 1, False)), 2, 1)
    (plan,) = pipeline_plans(
        placement, {"B": "169.254.1.2"}, model_path="/m", num_layers=30, compute_dtype="auto",
        layer_split="10", ring_base_port=40000, grpc_base_port=41000,
    )
    assert [s.host for s in plan.stages] == ["10.0.0.1", "169.254.1.2"]
    assert [(s.layers.start, s.layers.end) for s in plan.stages] == [(0, 10), (10, 30)]


def test_overlapping_port_ranges_are_refused():
    with pytest.raises(PlacementError, match=r"--ring-base-port 50000 .* overlaps --grpc-base-port 50002"):
        check_port_ranges(2, 50000, 50002)
    check_port_ranges(2, 50000, 50004)  # ring uses 50000..50003


def test_port_range_outside_usable_ports_is_refused():
    with pytest.raises(PlacementError, match=r"--grpc-base-port 65535"):
        check_port_ranges(2, 40000, 65535)


def test_a_replica_placed_again_avoids_the_node_it_lost_while_others_have_room():
    cluster = _nodes(("head", 1, True), ("gone", 1, False), ("new", 1, False))
    assert [n.node_id for n in without_lost_nodes(cluster, {"gone"}, 2)] == ["head", "new"]
    # without the lost node there would not be room: keep it rather than not place at all
    assert [n.node_id for n in without_lost_nodes(cluster, {"gone"}, 3)] == ["head", "gone", "new"]
    placement = place_stages(without_lost_nodes(cluster, {"gone"}, 2), 2, 1)
    assert "gone" not in {slot.node_id for slot in placement.replicas[0]}
