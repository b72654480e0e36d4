"""MeshCoordinator on the real default model: PP=2, DP=1, local Ray, real MLX ring.

All stages serve, the snapshot matches the plan, a SIGKILLed rank-1 stage
makes the replica unhealthy within seconds and the coordinator brings the
whole pipeline back (restarts=1) able to generate, and ``stop()`` leaves no
process and no bound port.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from coordinator.mesh import MeshConfig, MeshCoordinator
from tests.coordinator.conftest import mesh_ports
from tests.coordinator.helpers import assert_all_released, stage_ports, wait_until

pytestmark = pytest.mark.e2e



def _generate(target: str, token: str, max_tokens: int = 4) -> list[int]:
    import grpc

    from stagemesh_core.mesh_token import call_metadata
    from stagemesh_core.v1 import stage_pb2, stage_pb2_grpc
    from tests.stage_calls import generate

    with grpc.insecure_channel(target) as channel:
        request = stage_pb2.GenerateRequest(
            request_id="coordinator-test", prompt_token_ids=[504, 3575, 282, 4649, 314], max_tokens=max_tokens,
            sampling=stage_pb2.SamplingParams(temperature=0.0, top_p=1.0), ignore_eos=True)
        return generate(stage_pb2_grpc.StageStub(channel), request, metadata=call_metadata(token), timeout=60)


def test_pp2_serves_recovers_from_a_killed_stage_and_stops_clean(monkeypatch):
    import ray

    from stage_worker.checkpoint.default_model import resolve_model_path

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ring, grpc_base = mesh_ports(2)
    config = MeshConfig(
        model_path=resolve_model_path(None), served_model_name="SmolLM2-135M-Instruct", num_layers=30,
        pipeline_parallel_size=2, data_parallel_size=1, ring_base_port=ring, grpc_base_port=grpc_base,
        max_num_seqs=4, startup_timeout_s=240)
    coordinator = MeshCoordinator(config)
    pids: list[int | None] = []
    try:
        snapshot = coordinator.start()
        (replica,) = snapshot.replicas
        assert replica.healthy and replica.restarts == 0
        assert [(s.rank, s.layers, s.host, s.grpc_port, s.ring_port) for s in replica.stages] == [
            (0, (0, 15), "127.0.0.1", grpc_base, ring),
            (1, (15, 30), "127.0.0.1", grpc_base + 1, ring + 1),
        ]
        node = ray.get_runtime_context().get_node_id()
        assert all(s.node_id == node and s.state == "serving" and s.pid for s in replica.stages)
        # Dense weights exactly when an optimized BLAS is loaded (--dequantize auto on the CPU backend).
        assert all(s.compute_dtype == "float32" and s.quantized == (s.blas not in ("openblas", "mkl"))
                   for s in replica.stages)
        reference = _generate(replica.entry.grpc_target, coordinator.mesh_token)
        assert len(reference) == 4
        pids += [s.pid for s in replica.stages]

        killed_at = time.monotonic()
        os.kill(replica.stages[1].pid, signal.SIGKILL)
        wait_until(lambda: not coordinator.snapshot().replicas[0].healthy, 10, "replica marked unhealthy")
        wait_until(lambda: coordinator.snapshot().replicas[0].healthy, 120, "replica restarted")
        recovered = coordinator.snapshot().replicas[0]
        print(f"recovered {time.monotonic() - killed_at:.1f} s after the kill")
        assert recovered.restarts == 1
        assert {s.pid for s in recovered.stages}.isdisjoint(pids)
        pids += [s.pid for s in recovered.stages]
        # same greedy tokens after the restart
        assert _generate(recovered.entry.grpc_target, coordinator.mesh_token) == reference
    finally:
        last = coordinator.snapshot()
        coordinator.stop()
    assert_all_released(pids, stage_ports(last, 2, ring))
    assert not ray.is_initialized()
