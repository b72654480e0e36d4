"""Mutual TLS on a stage's real gRPC server, with certificates made here by ``stagemesh certs``: a client
with a certificate from the mesh's CA gets through; one from a foreign CA, one without a certificate, and
a plaintext one are refused; grpcurl with the node's files works; the command writes what it says."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stage_worker.engine.stage_status import StageStatus
from stage_worker.service.grpc_service import StageDescription, start_grpc_server
from stagemesh.certs import NodeSpec, make_ca, make_node_cert
from stagemesh_core.grpc_tls import TlsFiles, channel_credentials, open_channel, read_tls_dir
from stagemesh_core.mesh_token import call_metadata, generate_token
from stagemesh_core.states import StageState
from stagemesh_core.v1 import stage_pb2, stage_pb2_grpc
from tests.conftest import free_port_base

TOKEN = generate_token()


def _node_dir(root: Path, name: str, ca: tuple[bytes, bytes]) -> Path:
    cert, key = make_node_cert(ca[0], ca[1], NodeSpec(name, ("127.0.0.1",)))
    folder = root / name
    folder.mkdir()
    (folder / "ca.pem").write_bytes(ca[0])
    (folder / "node.pem").write_bytes(cert)
    (folder / "node.key").write_bytes(key)
    return folder


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    mesh_ca, foreign_ca = make_ca("mesh CA"), make_ca("someone else's CA")
    return {"mesh": read_tls_dir(str(_node_dir(root, "mac-a", mesh_ca))),
            "peer": read_tls_dir(str(_node_dir(root, "mac-b", mesh_ca))),
            "foreign": read_tls_dir(str(_node_dir(root, "intruder", foreign_ca))),
            "dirs": root}


@pytest.fixture(scope="module")
def tls_stage(pki):
    port = free_port_base(1)
    description = StageDescription(
        replica=0, rank=1, world_size=2, layers=(15, 30), num_layers=30, host="127.0.0.1", grpc_port=port,
        ring_port=0, lane_port=0, node_id="", model="m", compute_dtype="float32", max_num_seqs=4,
        max_model_len=64, version="test")
    status = StageStatus()
    server, _ = start_grpc_server(description, status, mesh_token=TOKEN, tls=pki["mesh"])
    status.set_state(StageState.SERVING)
    yield f"127.0.0.1:{port}"
    server.stop(grace=None)


def _info(channel: grpc.Channel) -> stage_pb2.StageInfo:
    return stage_pb2_grpc.StageStub(channel).GetStageInfo(stage_pb2.GetStageInfoRequest(), timeout=10)


def test_a_client_with_the_mesh_ca_certificate_gets_through(tls_stage, pki):
    with open_channel(tls_stage, pki["peer"]) as channel:  # another node's certificate, same CA
        assert _info(channel).layer_start == 15
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        # TLS is the transport; the token still guards state-changing calls.
        with pytest.raises(grpc.RpcError) as refused:
            stage_pb2_grpc.StageStub(channel).Drain(stage_pb2.DrainRequest(), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        drained = stage_pb2_grpc.StageStub(channel).Drain(stage_pb2.DrainRequest(), timeout=10,
                                                          metadata=call_metadata(TOKEN))
        assert drained.running == 0


def _refused(channel: grpc.Channel) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as refused:
        _info(channel)
    return refused.value


def test_a_client_certificate_from_a_foreign_ca_is_refused(tls_stage, pki):
    # It trusts the mesh's CA (so the server's certificate checks out) but presents its own CA's certificate.
    foreign = pki["foreign"]
    impostor = TlsFiles(foreign.directory, pki["mesh"].ca, foreign.cert, foreign.key)
    with open_channel(tls_stage, impostor) as channel:
        assert _refused(channel).code() == grpc.StatusCode.UNAVAILABLE
    with open_channel(tls_stage, foreign) as channel:  # and one that trusts only its own CA
        assert _refused(channel).code() == grpc.StatusCode.UNAVAILABLE


def test_a_client_without_a_certificate_or_without_tls_is_refused(tls_stage, pki):
    no_cert = grpc.ssl_channel_credentials(root_certificates=pki["mesh"].ca)
    with grpc.secure_channel(tls_stage, no_cert) as channel:
        assert _refused(channel).code() == grpc.StatusCode.UNAVAILABLE
    with grpc.insecure_channel(tls_stage) as channel:
        assert _refused(channel).code() == grpc.StatusCode.UNAVAILABLE
    assert channel_credentials(pki["mesh"]) is not None


def _grpcurl() -> str:
    beside = Path(sys.executable).parent / "grpcurl"
    return str(beside) if beside.exists() else "grpcurl"


@pytest.mark.e2e
def test_grpcurl_with_the_node_files_checks_health_and_without_them_cannot(tls_stage, pki):
    mac_b = pki["dirs"] / "mac-b"
    health = subprocess.run([_grpcurl(), "-cacert", str(mac_b / "ca.pem"), "-cert", str(mac_b / "node.pem"),
                             "-key", str(mac_b / "node.key"), "-d", '{"service":""}', tls_stage,
                             "grpc.health.v1.Health/Check"], capture_output=True, text=True, timeout=30)
    # It answers (SERVING, or NOT_SERVING once the test above drained this stage).
    assert health.returncode == 0 and json.loads(health.stdout)["status"] in ("SERVING", "NOT_SERVING"), health.stderr
    without = subprocess.run([_grpcurl(), "-cacert", str(mac_b / "ca.pem"), "-d", '{"service":""}', tls_stage,
                              "grpc.health.v1.Health/Check"], capture_output=True, text=True, timeout=30)
    assert without.returncode != 0


@pytest.mark.e2e
def test_certs_command_writes_a_ca_and_each_nodes_directory(tmp_path):
    done = subprocess.run([sys.executable, "-m", "stagemesh.cli", "certs", str(tmp_path), "--node",
                           "mac-a=169.254.10.1,mac-a.local", "--node", "mac-b=169.254.10.2"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    for node in ("mac-a", "mac-b"):
        files = read_tls_dir(str(tmp_path / node))
        assert files.ca == (tmp_path / "ca.pem").read_bytes()
        assert stat.S_IMODE(os.stat(tmp_path / node / "node.key").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "ca.key").st_mode) == 0o600
    again = subprocess.run([sys.executable, "-m", "stagemesh.cli", "certs", str(tmp_path), "--node", "mac-c=10.0.0.3"],
                           capture_output=True, text=True, timeout=60)
    assert "existing CA" in again.stdout and read_tls_dir(str(tmp_path / "mac-c")).ca == files.ca
    bad = subprocess.run([sys.executable, "-m", "stagemesh.cli", "certs", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--node" in bad.stderr


def test_doctor_finds_a_foreign_ca_a_wrong_key_an_expiring_certificate_and_a_missing_name(tmp_path, pki):
    import datetime as dt

    from stagemesh.doctor.tls import check_tls

    now = dt.datetime.now(dt.UTC)

    def problems(files: TlsFiles, host_ip: str | None = None, key_mode: int = 0o600, at: dt.datetime = now):
        return [(f.severity, f.problem) for f in check_tls(files, host_ip=host_ip, key_mode=key_mode, now=at)]

    good = problems(pki["mesh"])
    assert [s for s, _ in good] == ["ok"] and "names 127.0.0.1" in good[0][1]
    mesh, foreign = pki["mesh"], pki["foreign"]
    assert any("not signed by" in p for s, p in problems(TlsFiles("d", mesh.ca, foreign.cert, foreign.key))
               if s == "error")
    assert any("is not the key of" in p for _, p in problems(TlsFiles("d", mesh.ca, mesh.cert, pki["peer"].key)))
    assert any("does not name 169.254.10.1" in p for _, p in problems(mesh, host_ip="169.254.10.1"))
    assert any("expires on" in p for s, p in problems(mesh, at=now + dt.timedelta(days=810)) if s == "warning")
    assert any("expired on" in p for s, p in problems(mesh, at=now + dt.timedelta(days=900)) if s == "error")
    assert any("readable by others" in p for _, p in problems(mesh, key_mode=0o644))


@pytest.mark.e2e
def test_doctor_command_checks_the_tls_directory(tmp_path):
    subprocess.run([sys.executable, "-m", "stagemesh.cli", "certs", str(tmp_path), "--node", "mac-a=127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    (tmp_path / "mac-a" / "node.key").chmod(0o644)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "STAGEMESH_HOST_IP")}
    done = subprocess.run([sys.executable, "-m", "stagemesh.cli", "doctor", "--local", "--no-resolve", "--json",
                           "--grpc-tls-dir", str(tmp_path / "mac-a")], capture_output=True, text=True, timeout=120,
                          env=env)
    findings = [f for f in json.loads(done.stdout)["findings"] if f["check"] == "grpc-tls"]
    assert [f["severity"] for f in findings] == ["warning"] and "chmod 600" in findings[0]["fix"], findings
