"""``stagemesh doctor``'s edge: gather the facts the checks in ``doctor_checks`` judge.

Everything here reads the machine it runs on: the environment, the interfaces
(``psutil.net_if_addrs``), how this host's names resolve, which ports can be
bound and who holds the others, MLX's backend, the macOS firewall. In cluster
mode ``NodeProbe`` runs as a small Ray actor pinned to each node, so every node
reports its own facts, and the probes listen on each node's ports while the
others connect to them (reachability between nodes, firewall included).
MLX's backend and device come from ``stage_worker.model.device`` (what a stage
reports), the node's GPU count from ``stagemesh_core.gpus`` (what its
StageHost reports), so doctor says what the stages will see.

Only the addresses doctor is told about are ever contacted: the advertised
addresses of the cluster's nodes.
"""

from __future__ import annotations

import errno
import importlib.metadata
import importlib.util
import os
import platform
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from stagemesh.doctor.checks import HOST_IP, SERVE_OWNER, STAGE_OWNER, MeshPlan, NodeFacts

ENV_VARIABLES = (
    HOST_IP, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_DEFAULT_PYTHON_VERSION_MATCH_LEVEL", "RAY_AUTH_MODE",
    "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS", "STAGEMESH_RING_BASE_PORT", "STAGEMESH_GRPC_BASE_PORT",
    "STAGEMESH_GPU_PER_STAGE", "CUDA_VISIBLE_DEVICES",
)
SECRET_VARIABLES = ("RAY_AUTH_TOKEN",)
PACKAGES = ("stagemesh", "ray", "mlx", "mlx-lm")
FIREWALL = "/usr/libexec/ApplicationFirewall/socketfilterfw"
_RESOLVE_TIMEOUT_S = 3.0
_CONNECT_TIMEOUT_S = 2.0


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _run(argv: Sequence[str], timeout: float = 5.0) -> str | None:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return (done.stdout + done.stderr).strip()


def environment(env: dict[str, str] | None = None) -> dict[str, str]:
    source: Mapping[str, str] = os.environ if env is None else env
    found = {name: source[name] for name in ENV_VARIABLES if name in source}
    found.update({name: "<set>" for name in SECRET_VARIABLES if source.get(name)})
    return found


def interfaces() -> tuple[dict[str, list[str]], list[str]]:
    """IPv4 addresses per interface, and the interfaces that are down."""
    import psutil

    addresses = {name: sorted(a.address for a in addrs if a.family == socket.AF_INET)
                 for name, addrs in psutil.net_if_addrs().items()}
    stats = psutil.net_if_stats()
    down = sorted(name for name, s in stats.items() if not s.isup and addresses.get(name))
    return {name: addrs for name, addrs in addresses.items() if addrs}, down


def host_names() -> list[str]:
    """This host's names worth resolving: its hostname and its mDNS ``.local`` name(s)."""
    hostname = socket.gethostname()
    names = {hostname}
    short = hostname.split(".")[0]
    if short:
        names.add(f"{short}.local")
    if sys.platform == "darwin":
        local = _run(["scutil", "--get", "LocalHostName"])
        if local and " " not in local:
            names.add(f"{local}.local")
    return sorted(names)


def resolve(names: Sequence[str], timeout_s: float = _RESOLVE_TIMEOUT_S) -> dict[str, list[str]]:
    """IPv4 addresses each name resolves to ([] when it does not, or not within ``timeout_s``)."""
    results: dict[str, list[str]] = {}

    def lookup(name: str) -> None:
        try:
            infos = socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)
            results[name] = sorted({str(info[4][0]) for info in infos})  # AF_INET: (address, port)
        except OSError:
            results[name] = []

    threads = [threading.Thread(target=lookup, args=(n,), daemon=True) for n in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
    return {name: results.get(name, []) for name in names}


def _listening_pids(ports: set[int]) -> dict[int, int | None]:
    """port -> pid of the process listening on it (None when not visible)."""
    import psutil

    listening: list[tuple[int, int | None]] = []  # (port, pid)
    try:
        listening = [(c.laddr.port, c.pid) for c in psutil.net_connections(kind="tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr]
    except (psutil.AccessDenied, PermissionError):  # macOS without root: look at our own processes
        for process in psutil.process_iter():
            try:
                listening += [(c.laddr.port, process.pid) for c in process.net_connections(kind="tcp")
                              if c.status == psutil.CONN_LISTEN and c.laddr]
            except (psutil.Error, PermissionError):
                continue
    return {port: pid for port, pid in listening if port in ports}


def _describe_process(pid: int | None) -> str:
    import psutil

    if pid is None:
        return "another process (not visible to this user: run doctor with sudo to name it)"
    try:
        command = " ".join(psutil.Process(pid).cmdline()) or psutil.Process(pid).name()
    except psutil.Error:
        return f"pid {pid}"
    if "stage_worker" in command and "--plan" in command:
        return f"pid {pid}: {STAGE_OWNER}"
    if "stagemesh" in command and " serve" in command:
        return f"pid {pid}: {SERVE_OWNER}"
    return f"pid {pid}: {command[:100]}"


def probe_ports(host: str, ports: Sequence[int]) -> tuple[dict[int, str | None], str | None]:
    """(port -> None if bindable else who holds it, error when ``host`` cannot be bound at all).

    Binds with SO_REUSEADDR like the stages do, so TIME_WAIT leftovers do not count.
    """
    result: dict[int, str | None] = {}
    busy: set[int] = set()
    for port in ports:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            result[port] = None
        except OSError as exc:
            if exc.errno == errno.EADDRNOTAVAIL:
                return {}, f"{exc.strerror} (the address is not on this node)"
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                busy.add(port)
            else:
                return {}, exc.strerror or str(exc)
        finally:
            sock.close()
    if busy:
        owners = _listening_pids(busy)
        for port in busy:
            result[port] = _describe_process(owners.get(port))
    return dict(sorted(result.items())), None


def mlx_facts() -> dict:
    facts: dict = {"mlx_device": None, "metal_available": None, "ring_available": None, "mlx_error": None,
                   "mlx_backend": None, "device_name": None, "device_memory_bytes": None}
    try:
        import mlx.core as mx

        from stage_worker.model.device import probe

        device = str(mx.default_device())
        match = re.search(r"(gpu|cpu)", device)
        facts["mlx_device"] = match.group(1) if match else device
        facts["metal_available"] = bool(mx.metal.is_available())
        facts["ring_available"] = bool(mx.distributed.is_available(backend="ring"))
        stage_device = probe()
        facts["mlx_backend"], facts["device_name"] = stage_device.backend, stage_device.name
        facts["device_memory_bytes"] = stage_device.memory_bytes
    except Exception as exc:  # ImportError, a broken wheel, a missing Metal library
        facts["mlx_error"] = f"{type(exc).__name__}: {exc}"
    return facts


def gpu_count() -> int:
    """NVIDIA GPUs this node's stages are spread over, counted as its StageHost counts them."""
    from coordinator.stage_host import nvidia_smi_list
    from stagemesh_core.gpus import node_gpu_count

    return node_gpu_count(os.environ, nvidia_smi_list(os.environ))


def firewall_facts() -> tuple[str | None, str | None]:
    """(on / off / None, this Python's verdict) for the macOS application firewall."""
    if sys.platform != "darwin" or not os.path.exists(FIREWALL):
        return None, None
    state = _run([FIREWALL, "--getglobalstate"]) or ""
    on = "off" if ("disabled" in state or "State = 0" in state) else ("on" if state else None)
    python = os.path.realpath(sys.executable)
    verdict = _run([FIREWALL, "--getappblocked", python]) if on == "on" else None
    return on, verdict


def translated() -> bool:
    if sys.platform != "darwin":
        return False
    return (_run(["sysctl", "-n", "sysctl.proc_translated"]) or "0").strip() == "1"


def auth_token() -> tuple[str, bool]:
    """(the Ray token file this process would use, whether it holds a token)."""
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or str(Path.home() / ".ray" / "auth_token")
    try:
        return path, bool(Path(path).read_text().strip())
    except OSError:
        return path, False


def default_model_path() -> str | None:
    """Where ``stagemesh serve`` finds the embedded default model, without downloading it (None: nowhere)."""
    from stage_worker.checkpoint.default_model import DEFAULT_GGUF_NAME, DEFAULT_PACKAGE, cache_dir

    try:
        spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / DEFAULT_GGUF_NAME
        if candidate.is_file():
            return str(candidate)
    cached = cache_dir() / DEFAULT_GGUF_NAME
    return str(cached) if cached.is_file() else None


def gather_node_facts(
    plan: MeshPlan,
    *,
    cluster: bool,
    node_id: str | None = None,
    ray_address: str | None = None,
    mlx_units: int | None = None,
    is_head: bool = False,
    gateway: bool = False,
    resolve_names: bool = True,
    check_ports: bool = True,
) -> NodeFacts:
    """Everything about the node this runs on (see the module docstring)."""
    env = environment()
    token_path, token_present = auth_token()
    addresses, down = interfaces()
    pinned = env.get(HOST_IP, "").strip()
    port_host = pinned or (ray_address if cluster else None) or "127.0.0.1"
    ports: dict[int, str | None] = {}
    port_error = None
    if check_ports:
        wanted = plan.stage_ports() + ([plan.gateway_port] if gateway else [])
        ports, port_error = probe_ports(port_host, wanted)
    firewall, firewall_python = firewall_facts()
    model_path = plan.model_path if plan.model_path is not None else default_model_path()
    return NodeFacts(
        hostname=socket.gethostname(), platform=sys.platform, machine=platform.machine(), translated=translated(),
        python=platform.python_version(), versions={p: _version(p) for p in PACKAGES}, **mlx_facts(),
        gpu_count=gpu_count(),
        env=env, interfaces=addresses, interfaces_down=down,
        resolved=resolve(host_names()) if resolve_names else {},
        port_host=port_host, ports=ports, port_error=port_error,
        firewall=firewall, firewall_python=firewall_python,
        auth_token_present=token_present, auth_token_path=token_path,
        model_path=model_path, model_present=bool(model_path and os.path.exists(model_path)),
        node_id=node_id, ray_address=ray_address, mlx_units=mlx_units, is_head=is_head,
    )


def connect(targets: Sequence[tuple[str, str, int]], timeout_s: float = _CONNECT_TIMEOUT_S) -> list[tuple]:
    """(dst label, host, port) -> (dst label, host, port, open / refused / timeout / unreachable / error)."""

    def one(target: tuple[str, str, int]) -> tuple:
        label, host, port = target
        try:
            with socket.create_connection((host, port), timeout=timeout_s):
                return (label, host, port, "open")
        except ConnectionRefusedError:
            return (label, host, port, "refused")
        except TimeoutError:
            return (label, host, port, "timeout")
        except OSError as exc:
            if exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
                return (label, host, port, "unreachable")
            return (label, host, port, exc.strerror or str(exc))

    if not targets:
        return []
    with ThreadPoolExecutor(max_workers=min(32, len(targets))) as pool:
        return list(pool.map(one, targets))


class NodeProbe:
    """Runs on one node (a Ray actor pinned there): its facts, listeners for the probe, connects to peers."""

    def __init__(self) -> None:
        self._listeners: list[socket.socket] = []

    def facts(self, plan: MeshPlan, node_id: str, ray_address: str, mlx_units: int, is_head: bool,
              resolve_names: bool = True) -> NodeFacts:
        return gather_node_facts(plan, cluster=True, node_id=node_id, ray_address=ray_address, mlx_units=mlx_units,
                                 is_head=is_head, gateway=is_head, resolve_names=resolve_names)

    def listen(self, host: str, ports: Sequence[int]) -> list[int]:
        """Listen on every port of ``ports`` that is free on ``host``; the ones now listening."""
        listening = []
        for port in ports:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((host, port))
                sock.listen(64)
            except OSError:
                sock.close()
                continue
            self._listeners.append(sock)
            listening.append(port)
        return listening

    def connect(self, targets: Sequence[tuple[str, str, int]]) -> list[tuple]:
        return connect(targets)

    def close(self) -> None:
        for sock in self._listeners:
            sock.close()
        self._listeners.clear()
