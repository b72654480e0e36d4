"""The layer planner end to end on a simulated two-node Ray cluster with unequal memory, the real model.

``ray.cluster_utils.Cluster`` runs two raylets on this machine, each with one
``mlx`` unit. Each node is started with its own ``STAGEMESH_NODE_MEMORY`` (a
big node of 4 GB, a small one of 500 MB), which its StageHost, its probe and
the stages it starts all inherit, as a launchd plist would set it on a real
Mac. So each node's budget is read on that node, not assumed from the head.

- ``stagemesh plan --json`` against ``RAY_ADDRESS`` shows the small node's own
  budget and gives it the shorter range, starting no stage;
- the mesh (PP=2, real SmolLM2 weights) gives the big node the longer range,
  each stage reports the KV capacity the plan predicted, and the pipeline
  answers greedily and correctly;
- a request that cannot fit is refused with its numbers before any stage loads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from coordinator.layer_planner import PlanError
from coordinator.mesh import MeshConfig, MeshCoordinator
from stage_worker.checkpoint.model_reader import read_model_spec
from stage_worker.model.model_facts import model_facts
from stagemesh.status import format_mesh
from tests.coordinator.conftest import mesh_ports
from tests.coordinator.helpers import loopback_cluster, wait_until

pytestmark = pytest.mark.e2e

BIG, SMALL = "4GB", "500MB"
MAX_MODEL_LEN = 2048  # with 500 MB x 0.8 the small node holds 9 of the 30 layers, so an even split cannot fit
FRANCE = "The capital of France is"


@pytest.fixture(scope="module")
def cluster():
    """(cluster, small node's id); the driver process itself carries no memory cap."""
    import ray

    # Each node's raylet, and so its workers and stages, inherit its memory cap.
    c, (_, small) = loopback_cluster([{"STAGEMESH_NODE_MEMORY": BIG}, {"STAGEMESH_NODE_MEMORY": SMALL}])
    try:
        yield c, small.node_id
    finally:
        ray.shutdown()
        c.shutdown()


def _config(default_model_path: str, **changes) -> MeshConfig:
    spec = read_model_spec(default_model_path)
    ring, grpc = mesh_ports(2)
    return MeshConfig(**{**dict(
        model_path=default_model_path, served_model_name="SmolLM2-135M-Instruct", num_layers=spec.num_layers,
        pipeline_parallel_size=2, dequantize="off", max_model_len=MAX_MODEL_LEN, max_num_seqs=4,
        ring_base_port=ring, grpc_base_port=grpc, startup_timeout_s=240, model_facts=model_facts(spec)),
        **changes})


def _generate(target: str, token: str, prompt: list[int], max_tokens: int = 8) -> list[int]:
    import grpc

    from stagemesh_core.mesh_token import call_metadata
    from stagemesh_core.v1 import stage_pb2, stage_pb2_grpc
    from tests.stage_calls import generate

    with grpc.insecure_channel(target) as channel:
        request = stage_pb2.GenerateRequest(
            request_id="plan-test", prompt_token_ids=prompt, max_tokens=max_tokens,
            sampling=stage_pb2.SamplingParams(temperature=0.0, top_p=1.0))
        return generate(stage_pb2_grpc.StageStub(channel), request, metadata=call_metadata(token), timeout=120)


def test_plan_command_reads_each_nodes_memory_where_it_runs(cluster):
    c, small_id = cluster
    env = {**os.environ, "RAY_ADDRESS": c.address}
    env.pop("STAGEMESH_NODE_MEMORY", None)
    done = subprocess.run(
        [sys.executable, "-m", "stagemesh.cli", "plan", "-pp", "2", "--max-model-len", str(MAX_MODEL_LEN),
         "--dequantize", "off", "--json"], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    (replica,) = json.loads(done.stdout)["replicas"]
    by_node = {s["node_id"]: s for s in replica["stages"]}
    small = by_node.pop(small_id)
    (big,) = by_node.values()
    assert small["budget_bytes"] == int(500e6 * 0.8) and big["budget_bytes"] == int(4e9 * 0.8)
    assert small["layers"][1] - small["layers"][0] < 15 < big["layers"][1] - big["layers"][0]


def test_the_bigger_node_gets_the_longer_range_and_the_mesh_answers(cluster, default_model_path):
    from stage_worker.checkpoint.tokenizer import load_tokenizer

    _, small_id = cluster
    coordinator = MeshCoordinator(_config(default_model_path))
    try:
        snapshot = coordinator.start()
        (replica,) = snapshot.replicas
        assert replica.healthy
        small = next(s for s in replica.stages if s.node_id == small_id)
        big = next(s for s in replica.stages if s.node_id != small_id)
        assert big.layers[1] - big.layers[0] > 15 > small.layers[1] - small.layers[0]
        assert [s.layers for s in replica.stages] == [(0, replica.stages[0].layers[1]),
                                                      (replica.stages[0].layers[1], 30)]
        # Each stage sized its KV exactly as the plan said (the stage's rule is the planner's).
        planned = {s.rank: s.kv_tokens for s in coordinator.memory_plans[0].replicas[0]}
        assert {s.rank: s.stats.kv_token_capacity for s in replica.stages} == planned

        tokenizer = load_tokenizer(read_model_spec(default_model_path))
        tokens = _generate(replica.entry.grpc_target, coordinator.mesh_token,
                           tokenizer.encode(FRANCE, add_special_tokens=False))
        assert tokenizer.decode(tokens).strip().startswith("Paris")
        # KV used / capacity per stage: the finished sequence's KV is released (snapshots refresh every second).
        wait_until(lambda: all(f"0/{tokens}" in format_mesh(coordinator.snapshot().to_json())
                               for tokens in planned.values()), 10, "KV released and shown in the status table")
    finally:
        coordinator.stop()


def test_a_request_that_cannot_fit_is_refused_with_its_numbers_before_anything_loads(cluster, default_model_path):
    _, small_id = cluster
    coordinator = MeshCoordinator(_config(default_model_path, memory_fraction=0.5))
    with pytest.raises(PlanError) as refused:
        coordinator.start()
    message = str(refused.value)
    assert "budget 250 MB (--memory-fraction 0.5 x 500 MB)" in message
    assert "not even one layer" in message and "short by" in message
    assert "raise --memory-fraction above 0.5" in message
    assert all(s.pid is None for r in coordinator.snapshot().replicas for s in r.stages)
