"""A real two-host mesh: two network namespaces on a veth "cable", like two Macs on Thunderbolt.

Host A (10.0.0.1) runs ``mesh.sh head`` and ``mesh.sh serve``; host B (10.0.0.2)
runs ``mesh.sh worker``. Every process of the test runs inside the namespaces
(``ip netns exec``), which hold nothing but their loopback and their end of the
cable, and every request goes to 10.0.0.1 / 10.0.0.2. The test skips, with the
reason, when namespaces cannot be made; it never falls back to the host's network.

Checks: the network step (addresses, hosts block, the peer answers), ``stagemesh
doctor`` across both nodes, ``serve -pp 2`` with stage 1 on 10.0.0.2 (``/mesh``,
the ring hostfile, the ring's TCP connections across the cable), completions and
chat through the gateway, ``mesh.sh status`` with grpcurl, ``serve -dp 2`` with a
replica on each host, and ``mesh.sh down`` leaving no process behind.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from stagemesh_core.plan import PipelinePlan, StageLaunch
from tests.deploy.conftest import MESH_SH
from tests.deploy.netns import ADDRESS_A, ADDRESS_B, NamespacesUnavailable, TwoHosts, make_two_hosts

pytestmark = pytest.mark.e2e

PYTHON = sys.executable
VENV = str(Path(PYTHON).parent.parent)
CLIENT = str(Path(__file__).with_name("netns_client.py"))
MODEL = "SmolLM2-135M-Instruct"
RING_BASE, GRPC_BASE, GATEWAY_PORT = 23000, 24000, 8000  # inside fresh namespaces every port is free
URL = f"http://{ADDRESS_A}:{GATEWAY_PORT}"
PROMPTS = ["The capital of France is", "The capital of Germany is", "The capital of Italy is"]


@dataclass
class Mesh:
    hosts: TwoHosts
    work: Path

    def mesh(self, host: str, *args: str, timeout: float = 300) -> str:
        argv = ["bash", str(MESH_SH), "--venv", VENV, "--state-dir", str(self.work / host),
                "--auth-token-path", str(self.work / "ray_auth_token"), "--ring-base-port", str(RING_BASE),
                "--grpc-base-port", str(GRPC_BASE), *args]
        done = self.hosts.run(host, argv, timeout=timeout)
        assert done.returncode == 0, f"mesh.sh {' '.join(args)} on host {host} failed:\n{done.stdout}\n{done.stderr}"
        return done.stdout

    def client(self, *args: str, host: str = "a") -> object:
        done = self.hosts.run(host, [PYTHON, CLIENT, *args], timeout=180)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    def log(self, host: str, name: str) -> str:
        path = self.work / host / "logs" / f"com.stagemesh.{name}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    work = tmp_path_factory.mktemp("two-hosts")
    try:
        hosts = make_two_hosts("d", work)
    except NamespacesUnavailable as exc:
        pytest.skip(f"cannot create network namespaces, and this test never uses the host's network: {exc}")
    mesh = Mesh(hosts, work)
    started = time.monotonic()
    try:
        for host, ip, peer, peer_name, veth in (("a", ADDRESS_A, ADDRESS_B, "host-b", hosts.veth_a),
                                                ("b", ADDRESS_B, ADDRESS_A, "host-a", hosts.veth_b)):
            mesh.mesh(host, "network", "--ip", ip, "--peer", peer, "--peer-name", peer_name, "--name", f"host-{host}",
                      "--interface", veth, "--hosts-file", str(work / f"hosts-{host}"),
                      *(["--no-check"] if host == "a" else []))
        mesh.mesh("a", "head", "--ip", ADDRESS_A, "--temp-dir", hosts.temp_dir("a"), "--num-cpus", "2")
        mesh.mesh("b", "worker", "--ip", ADDRESS_B, "--head", ADDRESS_A, "--temp-dir", hosts.temp_dir("b"),
                  "--num-cpus", "2")
        print(f"two hosts up in {time.monotonic() - started:.1f} s")
        yield mesh
    finally:
        for host, args in (("a", ("down", "--only", "serve")), ("b", ("down",)), ("a", ("down",))):
            hosts.run(host, ["bash", str(MESH_SH), "--venv", VENV, "--state-dir", str(work / host), *args],
                      timeout=120)
        leftovers = hosts.teardown()
        print(f"two hosts torn down ({len(leftovers)} leftover process(es) killed); "
              f"{time.monotonic() - started:.1f} s in all")


def test_the_network_step_pins_addresses_and_the_peer_answers(cluster):
    hosts = cluster.hosts
    for host, ip, veth in (("a", ADDRESS_A, hosts.veth_a), ("b", ADDRESS_B, hosts.veth_b)):
        addresses = hosts.run(host, ["ip", "-o", "-4", "addr", "show", "dev", veth]).stdout
        assert f"inet {ip}/24" in addresses
    assert (cluster.work / "hosts-a").read_text().endswith(
        "# >>> stagemesh (mesh.sh network) >>>\n10.0.0.1 host-a host-a.local\n10.0.0.2 host-b host-b.local\n"
        "# <<< stagemesh <<<\n")
    again = cluster.mesh("a", "network", "--ip", ADDRESS_A, "--peer", ADDRESS_B, "--peer-name", "host-b", "--name",
                         "host-a", "--interface", hosts.veth_a, "--hosts-file", str(cluster.work / "hosts-a"))
    assert "already has 10.0.0.1/24" in again and "already up to date" in again
    assert "10.0.0.2 (host-b) answers" in again


def test_doctor_checks_both_nodes_across_the_cable(cluster):
    env = cluster.hosts.env(RAY_ADDRESS=f"{ADDRESS_A}:6379", RAY_AUTH_MODE="token",
                            RAY_AUTH_TOKEN_PATH=str(cluster.work / "ray_auth_token"))
    done = cluster.hosts.run("a", [PYTHON, "-m", "stagemesh.cli", "doctor", "--json", "-pp", "2", "--ring-base-port",
                                   str(RING_BASE), "--grpc-base-port", str(GRPC_BASE)], env=env, timeout=120)
    report = json.loads(done.stdout)
    errors = [f for f in report["findings"] if f["severity"] == "error"]
    assert done.returncode == 0 and not errors, errors or done.stderr
    nodes = {n["env"]["STAGEMESH_HOST_IP"]: n for n in report["nodes"]}
    assert set(nodes) == {ADDRESS_A, ADDRESS_B}
    assert [nodes[a]["mlx_units"] for a in (ADDRESS_A, ADDRESS_B)] == [1, 1]
    assert nodes[ADDRESS_A]["is_head"] and not nodes[ADDRESS_B]["is_head"]
    assert nodes[ADDRESS_B]["ray_address"] == ADDRESS_B
    assert ADDRESS_B in [a for addrs in nodes[ADDRESS_B]["interfaces"].values() for a in addrs]
    reaches = report["reachability"]
    assert reaches and all(r["result"] == "open" for r in reaches)
    assert {(r["host"], r["port"]) for r in reaches} >= {(ADDRESS_B, RING_BASE + 1), (ADDRESS_A, GRPC_BASE)}
    # Each node saw its own name resolve to loopback (the machine's /etc/hosts): the .local pitfall, found.
    assert any(f["check"] == "name-resolution" and f["severity"] == "warning" for f in report["findings"])


def _stage_plan(pid: int) -> PipelinePlan:
    """The plan a running stage was started with (inside its --launch file)."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    path = argv[argv.index(b"--launch") + 1].decode()
    return StageLaunch.from_json(Path(path).read_text()).plan


def test_pp2_puts_stage_1_on_the_other_host(cluster):
    started = time.monotonic()
    out = cluster.mesh("a", "serve", "--ip", ADDRESS_A, "--port", str(GATEWAY_PORT), "--", "-pp", "2")
    assert "serve: healthy" in out, cluster.log("a", "serve")
    print(f"serve -pp 2 healthy in {time.monotonic() - started:.1f} s")
    mesh = cluster.client("mesh", URL)
    (replica,) = mesh["replicas"]
    stages = replica["stages"]
    assert [s["host"] for s in stages] == [ADDRESS_A, ADDRESS_B]
    assert [s["layers"] for s in stages] == [[0, 15], [15, 30]]
    assert [s["ring_port"] for s in stages] == [RING_BASE, RING_BASE + 1]
    assert [s["grpc_port"] for s in stages] == [GRPC_BASE, GRPC_BASE + 1]
    assert all(s["healthy"] for s in stages) and stages[0]["node_id"] != stages[1]["node_id"]
    # The ring hostfile each stage joins MLX's ring with holds the namespace addresses.
    for stage in stages:
        plan = _stage_plan(stage["pid"])
        assert plan.ring_hostfile() == [[f"{ADDRESS_A}:{RING_BASE}"], [f"{ADDRESS_B}:{RING_BASE + 1}"]]
        assert [s.lane_port for s in plan.stages] == [RING_BASE + 2, RING_BASE + 3]
    # Stage 1 lives in host B's namespace, and the lanes that carry the hidden states (the default hop
    # transport) cross the cable both ways: A connects to B's lane, B to A's.
    assert stages[1]["pid"] in cluster.hosts.pids("b") and stages[0]["pid"] in cluster.hosts.pids("a")
    sockets = cluster.hosts.run("a", ["ss", "-tnH", "state", "established"]).stdout.splitlines()
    assert any(f"{ADDRESS_B}:{RING_BASE + 3}" in line for line in sockets), sockets
    assert any(f"{ADDRESS_A}:{RING_BASE + 2}" in line and ADDRESS_B in line for line in sockets), sockets

    completions = cluster.client("complete", URL, MODEL, "1", PROMPTS[0])
    assert "Paris" in completions[0]["text"]
    chat = cluster.client("chat", URL, MODEL, "What is the capital of France?")
    assert "Paris" in chat["text"]
    # The gateway listens on the address it was given, and only there.
    assert cluster.client("refused", "127.0.0.1", str(GATEWAY_PORT)) is True

    for host in ("a", "b"):  # from the worker too: it finds the gateway through the head's address
        status = cluster.mesh(host, "status")
        assert f"{ADDRESS_A}:{GRPC_BASE}" in status and f"{ADDRESS_B}:{GRPC_BASE + 1}" in status
        assert status.count('{"status":"SERVING"}') == 2
        assert "1/1 replicas healthy" in status and "2.0/2.0 mlx" in status


def test_dp2_puts_a_replica_on_each_host(cluster):
    started = time.monotonic()
    out = cluster.mesh("a", "serve", "--ip", ADDRESS_A, "--port", str(GATEWAY_PORT), "--", "-dp", "2")
    assert "settings changed" in out and "serve: healthy" in out, cluster.log("a", "serve")
    print(f"serve -dp 2 healthy in {time.monotonic() - started:.1f} s")
    mesh = cluster.client("mesh", URL)
    hosts = {r["replica"]: [s["host"] for s in r["stages"]] for r in mesh["replicas"]}
    assert hosts == {0: [ADDRESS_A], 1: [ADDRESS_B]}
    results = cluster.client("complete", URL, MODEL, "2", *PROMPTS)
    by_prompt = {}
    for result in results:
        by_prompt.setdefault(result["prompt"], set()).add(result["text"])
    assert all(len(texts) == 1 for texts in by_prompt.values()), by_prompt  # both replicas agree, greedy
    assert "Paris" in next(iter(by_prompt[PROMPTS[0]]))
    assert "Berlin" in next(iter(by_prompt[PROMPTS[1]]))
    busy = [r["replica"] for r in cluster.client("mesh", URL)["replicas"] if r["stages"][0]["stats"]["batches"] > 0]
    assert busy == [0, 1]  # the gateway balanced the six concurrent requests over both hosts


def test_down_stops_everything_it_started(cluster):
    cluster.mesh("a", "down", "--only", "serve")
    cluster.mesh("b", "down")
    cluster.mesh("a", "down")
    for host in ("a", "b"):
        assert cluster.hosts.pids(host) == [], f"processes left in host {host}"
        assert not list((cluster.work / host).glob("*.pid"))
