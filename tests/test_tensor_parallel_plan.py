"""Tensor parallelism's pure decisions: the group ports, the plan's groups, placement of every worker, the group
handshake and environment, a worker's KV and planned share, and which models and sizes shard."""

from __future__ import annotations

import dataclasses

import pytest

from coordinator.placement import ClusterNode, PlacementError, check_port_ranges, pipeline_plan, place_stages
from stage_worker.transport.group import GroupIdentity, check_leader, group_environment
from stagemesh_core.errors import UserError
from stagemesh_core.memory import LayerKV, ModelFacts, StageKV, TensorBytes
from stagemesh_core.plan import PipelinePlan, StageLaunch, make_local_plan
from stagemesh_core.ports import data_plane_ports, member_ports, stage_ports


def test_every_worker_of_every_group_gets_ports_of_its_own_inside_the_documented_ranges():
    s, t, ring, grpc = 4, 2, 32323, 50051
    bound = []
    for g in range(s):
        stage = stage_ports(g, s, ring, grpc)
        bound += [stage.ring, stage.lane, stage.grpc]
        for m in range(t):
            ports = member_ports(g, m, s, t, ring, grpc)
            bound.append(ports.group)
            if m:
                bound += [ports.lane, ports.grpc]
            else:
                assert (ports.lane, ports.grpc) == (stage.lane, stage.grpc)
    assert len(bound) == len(set(bound))
    data = [p for p in bound if p < grpc]
    assert min(data) == ring and max(data) == ring + data_plane_ports(s, t) - 1 == ring + s * (2 * t + 1) - 1
    assert max(p for p in bound if p >= grpc) == grpc + s * t - 1
    assert data_plane_ports(s, 1) == 2 * s


def test_a_plan_carries_each_stage_group_and_survives_its_json():
    plan = make_local_plan("m", 30, 2, "auto", tensor_parallel_size=2, ring_base_port=40000, grpc_base_port=41000)
    assert [(w.rank, w.member) for w in plan.workers] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert plan.group_hostfile(1) == [["127.0.0.1:40006"], ["127.0.0.1:40007"]]
    assert plan.worker(1, 1).ring_port == 0 and plan.worker(1, 1).layers == plan.stages[1].layers
    assert PipelinePlan.from_json(plan.to_json()) == plan
    launch = StageLaunch(plan, 1, member=1)
    assert StageLaunch.from_json(launch.to_json()) == launch and launch.is_member and launch.me.grpc_port == 41003
    assert launch.stages_sharing_host() == 4
    with pytest.raises(UserError, match="member 2 outside"):
        StageLaunch(plan, 0, member=2)
    with pytest.raises(UserError, match="--hop-transport ring cannot carry"):
        make_local_plan("m", 30, 2, "auto", tensor_parallel_size=2, hop_transport="ring")
    with pytest.raises(UserError, match="--tp-backend 'mpi'"):
        make_local_plan("m", 30, 1, "auto", tensor_parallel_size=2, tp_backend="mpi")


def test_placement_spreads_a_group_over_nodes_and_names_the_units_it_lacks():
    nodes = [ClusterNode("a", "10.0.0.1", 2, is_head=True), ClusterNode("b", "10.0.0.2", 2)]
    placement = place_stages(nodes, 1, 2, tensor_parallel_size=2)
    for replica in placement.replicas:
        assert [(s.rank, s.member) for s in replica] == [(0, 0), (0, 1)]
        assert len({s.node_id for s in replica}) == 2  # one Mac each
    assert placement.replicas[0][0].node_id == "a"
    plan = pipeline_plan(0, [s.address for s in placement.replicas[0]], data_parallel_size=2, model_path="m",
                         num_layers=30, compute_dtype="auto", ring_base_port=40000, grpc_base_port=41000,
                         tensor_parallel_size=2)
    assert [w.host for w in plan.workers] == ["10.0.0.1", "10.0.0.2"]
    with pytest.raises(PlacementError, match=r"x --tensor-parallel-size 3 needs 6 'mlx' units .*pp x dp x tp <= 4"):
        place_stages(nodes, 2, 1, tensor_parallel_size=3)
    with pytest.raises(PlacementError, match="ring base port|--ring-base-port"):
        check_port_ranges(4, 65520, 50051, 2)  # -tp 1 would fit: 8 ports, not 20
    check_port_ranges(4, 65520, 50051, 1)


def _identity(**changes) -> GroupIdentity:
    fields = dict(replica=0, rank=1, member=1, size=2, layers=(15, 30), fingerprint="f", hidden_size=576,
                  wire_dtype="float32", backend="ring")
    return GroupIdentity(**{**fields, **changes})


def test_a_member_accepts_only_its_own_worker_0():
    me = _identity()
    assert check_leader(me, _identity().to_body()) is None
    assert "stage 0" in check_leader(me, _identity(rank=0).to_body())
    assert "member 2 of a group of 3" in check_leader(me, _identity(member=2, size=3).to_body())
    assert "different model" in check_leader(me, _identity(fingerprint="g").to_body())
    assert "--dtype" in check_leader(me, _identity(wire_dtype="float16").to_body())
    assert "--tp-backend" in check_leader(me, _identity(backend="jaccl").to_body())


def test_each_backend_finds_its_group_from_the_plan():
    ring = make_local_plan("m", 30, 1, "auto", tensor_parallel_size=2, ring_base_port=40000)
    assert group_environment(ring, 0, 1, "/tmp/h.json") == {"MLX_RANK": "1", "MLX_WORLD_SIZE": "2",
                                                            "MLX_HOSTFILE": "/tmp/h.json"}
    nccl = make_local_plan("m", 30, 1, "auto", tensor_parallel_size=2, ring_base_port=40000, tp_backend="nccl")
    assert group_environment(nccl, 0, 0, "")["NCCL_HOST_IP"] == "127.0.0.1"
    assert group_environment(nccl, 0, 0, "")["NCCL_PORT"] == str(nccl.stages[0].group_port)
    jaccl = make_local_plan("m", 30, 1, "auto", tensor_parallel_size=2, ring_base_port=40000, tp_backend="jaccl")
    assert group_environment(jaccl, 0, 1, "")["MLX_JACCL_COORDINATOR"] == f"127.0.0.1:{jaccl.stages[0].group_port}"


def test_a_worker_keeps_its_share_of_kv_and_the_planner_counts_a_share_of_each_layer():
    kv = StageKV(per_token=3 * 64 * 2 * 15, windows=((3 * 64 * 2, 128),))
    assert kv.share(2, 3).per_token == 2 * 64 * 2 * 15 and kv.share(1, 3).windows == ((64 * 2, 128),)
    facts = ModelFacts(num_layers=30, layer=TensorBytes(10, 1001), embedding=TensorBytes(0, 500),
                       head=TensorBytes(0, 500), kv_elements_per_token=384, kv_layers=(LayerKV(384),))
    half = facts.worker_share(2)
    assert half.layer == TensorBytes(5, 501) and half.kv_elements_per_token == 192
    assert half.kv_layers == (LayerKV(192),) and half.embedding == facts.embedding
    assert facts.worker_share(1) is facts
    # DeepSeek's MLA caches one latent for every head: each worker keeps it whole, as the stage counts it
    # (tensor_parallel.kv_part_held), so the plan halves the layer's weights only.
    latent = dataclasses.replace(facts, kv_latent=True).worker_share(2)
    assert latent.layer == TensorBytes(5, 501) and latent.kv_layers == facts.kv_layers
    assert latent.kv_elements_per_token == facts.kv_elements_per_token


def test_the_planner_counts_deepseek_v3s_latent_whole_per_worker(tmp_path):
    from stage_worker.checkpoint.model_reader import read_model_spec
    from stage_worker.model.model_facts import model_facts
    from tests.architectures import tiny_checkpoint

    deepseek = model_facts(read_model_spec(tiny_checkpoint("deepseek_v3", tmp_path / "d")))
    llama = model_facts(read_model_spec(tiny_checkpoint("llama", tmp_path / "l")))
    assert deepseek.kv_latent and not llama.kv_latent
    assert deepseek.worker_share(2).slice_kv(0, 1) == deepseek.slice_kv(0, 1)
    assert llama.worker_share(2).slice_kv(0, 1) != llama.slice_kv(0, 1)


def test_the_mlp_split_leans_away_from_the_worker_that_holds_more():
    from stage_worker.parallel.tensor_parallel import balance_intermediate

    # The default model's shapes: 30 layers, 3 KV groups split 2 + 1, the tied head on worker 0.
    shape = dict(layers=30, per_kv_group=576 * 64 * 8, per_feature=3 * 576)
    parts = balance_intermediate(1536, [2, 1], extra=[49152 * 576, 0], **shape)
    assert parts == [range(0, 416), range(416, 1536)]
    reads = [30 * (k * shape["per_kv_group"] + len(p) * shape["per_feature"]) + e
             for k, p, e in zip([2, 1], parts, [49152 * 576, 0], strict=True)]
    assert abs(reads[0] - reads[1]) < 30 * 32 * shape["per_feature"]  # within one aligned step
    assert balance_intermediate(1536, [1, 1], extra=[0, 0], **shape) == [range(0, 768), range(768, 1536)]
    # A head too big to balance leaves worker 0 one aligned group of features, never none.
    assert balance_intermediate(256, [1, 1], extra=[10**12, 0], **shape) == [range(0, 32), range(32, 256)]
