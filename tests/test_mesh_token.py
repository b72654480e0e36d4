"""The mesh token: the pure rules (which methods are open, how a token is resolved and compared),
and a real stage gRPC server (``start_grpc_server``, no model loaded) answered through the grpcio
client and grpcurl with and without the token."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stage_worker.engine.stage_status import StageStatus
from stage_worker.service.grpc_service import StageDescription, start_grpc_server
from stagemesh_core.errors import UserError
from stagemesh_core.mesh_token import (
    call_metadata,
    generate_token,
    requires_token,
    resolve_token,
    token_matches,
)
from stagemesh_core.states import StageState
from stagemesh_core.v1 import stage_pb2, stage_pb2_grpc
from tests.conftest import free_port_base

TOKEN = generate_token()


def test_only_health_reflection_and_stage_info_are_open():
    assert not requires_token("/grpc.health.v1.Health/Check")
    assert not requires_token("/grpc.health.v1.Health/Watch")
    assert not requires_token("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")
    assert not requires_token("/stagemesh.v1.Stage/GetStageInfo")
    for method in ("GenerateStream", "Abort", "Drain", "SomeMethodAddedNextYear"):
        assert requires_token(f"/stagemesh.v1.Stage/{method}")
    assert requires_token("/stagemesh.v2.Other/GetStageInfo")


def test_flag_wins_then_environment_then_a_fresh_random_token():
    assert resolve_token("f" * 20, {"STAGEMESH_MESH_TOKEN": "e" * 20}) == "f" * 20
    assert resolve_token(None, {"STAGEMESH_MESH_TOKEN": "e" * 20}) == "e" * 20
    one, two = resolve_token(None, {}), resolve_token(None, {})
    assert one != two and len(one) >= 40
    with pytest.raises(UserError, match="--mesh-token.*at least 16"):
        resolve_token("short", {})
    with pytest.raises(UserError, match="STAGEMESH_MESH_TOKEN.*printable ASCII"):
        resolve_token(None, {"STAGEMESH_MESH_TOKEN": "a token with spaces in it"})


def test_token_matches_only_the_exact_bearer_token():
    assert token_matches(call_metadata(TOKEN), TOKEN)
    assert token_matches([("authorization", f"bearer {TOKEN}")], TOKEN)  # scheme case-insensitive
    assert not token_matches(call_metadata(TOKEN + "x"), TOKEN)
    assert not token_matches(call_metadata(TOKEN[:-1]), TOKEN)
    assert not token_matches([("authorization", TOKEN)], TOKEN)  # no scheme
    assert not token_matches([], TOKEN)
    assert not token_matches(call_metadata(""), "")  # an empty expected token never matches


@pytest.fixture(scope="module")
def stage_server():
    """A stage's real gRPC server (Stage + health + reflection + the interceptor), in LOADING state."""
    port = free_port_base(1)
    description = StageDescription(
        replica=0, rank=0, world_size=2, layers=(0, 15), num_layers=30, host="127.0.0.1", grpc_port=port,
        ring_port=0, lane_port=0, node_id="", model="m", compute_dtype="float32", max_num_seqs=4,
        max_model_len=64, version="test")
    status = StageStatus()
    server, _ = start_grpc_server(description, status, mesh_token=TOKEN)
    status.set_state(StageState.SERVING)  # health SERVING; no engine: GenerateStream then answers UNAVAILABLE
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield f"127.0.0.1:{port}", channel
    channel.close()
    server.stop(grace=None)


def _generate_stream(channel, metadata=None):
    start = stage_pb2.GenerateStreamRequest(start=stage_pb2.GenerateRequest(request_id="r", prompt_token_ids=[1, 2],
                                                                            max_tokens=2))
    return list(stage_pb2_grpc.StageStub(channel).GenerateStream(iter([start]), timeout=10, metadata=metadata))


def test_state_changing_calls_without_the_token_are_unauthenticated(stage_server):
    _, channel = stage_server
    stub = stage_pb2_grpc.StageStub(channel)
    for call in (lambda md: _generate_stream(channel, md),
                 lambda md: stub.Abort(stage_pb2.AbortRequest(request_id="r"), timeout=10, metadata=md),
                 lambda md: stub.Drain(stage_pb2.DrainRequest(), timeout=10, metadata=md)):
        for metadata in (None, call_metadata("not-the-token-" + "x" * 20)):
            with pytest.raises(grpc.RpcError) as refused:
                call(metadata)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "mesh token" in refused.value.details() and TOKEN not in refused.value.details()
    # With the token the call reaches the handler: no engine here, so it says the stage is not serving yet.
    with pytest.raises(grpc.RpcError) as reached:
        _generate_stream(channel, call_metadata(TOKEN))
    assert reached.value.code() == grpc.StatusCode.UNAVAILABLE and "not serving yet" in reached.value.details()


def test_health_and_stage_info_answer_without_the_token(stage_server):
    _, channel = stage_server
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    info = stage_pb2_grpc.StageStub(channel).GetStageInfo(stage_pb2.GetStageInfoRequest(), timeout=10)
    assert info.world_size == 2 and info.layer_end == 15


def _grpcurl() -> str:
    beside = Path(sys.executable).parent / "grpcurl"
    return str(beside) if beside.exists() else "grpcurl"


@pytest.mark.e2e
def test_grpcurl_generate_stream_is_refused_without_the_token_and_health_still_answers(stage_server):
    target, _ = stage_server
    body = json.dumps({"start": {"request_id": "g", "prompt_token_ids": [1, 2], "max_tokens": 2}})
    refused = subprocess.run([_grpcurl(), "-plaintext", "-d", body, target, "stagemesh.v1.Stage/GenerateStream"],
                             capture_output=True, text=True, timeout=30)
    assert refused.returncode != 0 and "Unauthenticated" in refused.stderr, refused.stderr
    allowed = subprocess.run([_grpcurl(), "-plaintext", "-H", f"authorization: Bearer {TOKEN}", "-d", body,
                              target, "stagemesh.v1.Stage/GenerateStream"], capture_output=True, text=True,
                             timeout=30)
    assert "Unavailable" in allowed.stderr and "not serving yet" in allowed.stderr, allowed.stderr
    health = subprocess.run([_grpcurl(), "-plaintext", "-d", '{"service":""}', target,
                             "grpc.health.v1.Health/Check"], capture_output=True, text=True, timeout=30)
    assert health.returncode == 0 and json.loads(health.stdout)["status"] == "SERVING", health.stderr
    listed = subprocess.run([_grpcurl(), "-plaintext", target, "list"], capture_output=True, text=True, timeout=30)
    assert listed.returncode == 0 and "stagemesh.v1.Stage" in listed.stdout, listed.stderr
