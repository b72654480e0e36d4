"""`stagemesh doctor` on this machine: real facts, JSON out, exit codes. Loopback only; no name lookups."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from stagemesh.doctor.checks import MeshPlan
from stagemesh.doctor.facts import NodeProbe, connect, gather_node_facts, probe_ports
from tests.conftest import free_port_base


def doctor(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    run_env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "STAGEMESH_"))}
    run_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "stagemesh.cli", "doctor", "--no-resolve", *args],
                          capture_output=True, text=True, timeout=120, env=run_env)


def _ports(count: int) -> tuple[int, int, int]:
    ring = free_port_base(2 * count)
    grpc = free_port_base(count)
    gateway = free_port_base(1)
    return ring, grpc, gateway


@pytest.mark.e2e
def test_a_clean_node_passes_with_json():
    ring, grpc, gateway = _ports(2)
    done = doctor("--json", "-pp", "2", "--ring-base-port", str(ring), "--grpc-base-port", str(grpc),
                  "--port", str(gateway))
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["mode"] == "local" and report["ok"] is True
    assert report["plan"]["ring_base_port"] == ring and report["plan"]["pipeline_parallel_size"] == 2
    (node,) = report["nodes"]
    assert node["python"] and node["versions"]["mlx"] and node["mlx_device"] == "cpu"
    assert node["port_host"] == "127.0.0.1"
    assert sorted(int(p) for p in node["ports"]) == sorted([*range(ring, ring + 4), grpc, grpc + 1, gateway])
    assert node["resolved"] == {}
    assert {f["check"] for f in report["findings"]} >= {"mlx-backend", "host-ip", "ports"}
    for finding in report["findings"]:
        assert set(finding) == {"check", "severity", "node", "problem", "fix"}


@pytest.mark.e2e
def test_a_busy_port_fails_and_names_the_process():
    ring, grpc, gateway = _ports(1)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", grpc))
        listener.listen()
        done = doctor("--ring-base-port", str(ring), "--grpc-base-port", str(grpc), "--port", str(gateway))
    assert done.returncode == 1, done.stdout
    assert f"port {grpc} on 127.0.0.1 is taken by pid {os.getpid()}" in done.stdout
    assert "fix: stop that process, or move the range with --grpc-base-port" in done.stdout
    assert "1 error(s)" in done.stdout


@pytest.mark.e2e
def test_host_ip_that_is_not_here_fails():
    ring, grpc, gateway = _ports(1)
    done = doctor("--ring-base-port", str(ring), "--grpc-base-port", str(grpc), "--port", str(gateway),
                  env={"STAGEMESH_HOST_IP": "10.255.77.77"})
    assert done.returncode == 1
    assert "10.255.77.77 (the advertised address) is not on any interface" in done.stdout


@pytest.mark.e2e
def test_nothing_listening_at_ray_address_is_reported_fast():
    (port,) = [free_port_base(1)]
    done = doctor("--json", env={"RAY_ADDRESS": f"127.0.0.1:{port}"})
    assert done.returncode == 1
    report = json.loads(done.stdout)
    assert report["mode"] == "cluster"
    (finding,) = report["findings"]
    assert finding["check"] == "ray-join" and "nothing answers" in finding["problem"]


@pytest.mark.e2e
def test_flag_errors_exit_2():
    assert doctor("-pp", "0").returncode == 2


@pytest.mark.e2e
def test_strict_fails_on_warnings(tmp_path):
    ring, grpc, gateway = _ports(1)
    token = tmp_path / "auth_token"
    token.write_text("x" * 64)
    env = {"RAY_AUTH_TOKEN_PATH": str(token), "STAGEMESH_HOST_IP": "127.0.0.1"}  # auth mode unset: a warning
    args = ("--ring-base-port", str(ring), "--grpc-base-port", str(grpc), "--port", str(gateway))
    relaxed = doctor(*args, env=env)
    assert relaxed.returncode == 0, relaxed.stdout
    assert "WARN  ray-auth" in relaxed.stdout
    assert doctor("--strict", *args, env=env).returncode == 1
    quiet = doctor("-q", *args, env=env)
    assert "ok " not in quiet.stdout and "WARN" in quiet.stdout


@pytest.mark.e2e
def test_facts_on_loopback():
    ring = free_port_base(2)
    plan = MeshPlan(ring_base_port=ring, grpc_base_port=free_port_base(1), gateway_port=free_port_base(1))
    facts = gather_node_facts(plan, cluster=False, resolve_names=False)
    assert facts.port_host == "127.0.0.1" and all(v is None for v in facts.ports.values())
    assert facts.mlx_backend in ("cpu", "metal", "cuda") and facts.device_name and facts.gpu_count is not None
    assert "127.0.0.1" in [a for addrs in facts.interfaces.values() for a in addrs]
    ports, error = probe_ports("10.255.77.77", [ring])
    assert ports == {} and "not on this node" in error


def test_probe_listens_and_connects_on_loopback():
    base = free_port_base(2)
    probe = NodeProbe()
    try:
        assert probe.listen("127.0.0.1", [base]) == [base]
        results = probe.connect([("me", "127.0.0.1", base), ("me", "127.0.0.1", base + 1)])
        assert [r[3] for r in results] == ["open", "refused"]
    finally:
        probe.close()
    assert connect([]) == []


@pytest.mark.e2e
@pytest.mark.parametrize("flag", ["--help"])
def test_cli_help_lists_the_flags(flag):
    done = subprocess.run([sys.executable, "-m", "stagemesh.cli", "doctor", flag], capture_output=True, text=True)
    assert done.returncode == 0
    for option in ("--address", "--json", "--strict", "-pp", "--ring-base-port", "--no-resolve"):
        assert option in done.stdout
