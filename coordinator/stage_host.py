"""StageHost: the Ray actor that owns one stage process on one node.

One ``StageHost`` sits in each placement-group bundle. It is deliberately thin: the stage itself is a
subprocess (``python -m stage_worker --launch FILE``), never the actor, because MLX's ring cannot be
re-created inside a process (a broken pipeline needs fresh processes) and because it keeps Ray's worker out
of the stage's memory and CPU budget.

Contract (every method returns quickly; nothing here blocks on the stage): ``describe()`` (``HostInfo``: the
address the stage must advertise, versions, GPUs), ``node_memory()`` (for the layer planner),
``start(launch_json)`` (the stage's pid), ``poll()``, ``terminate()``, ``stop(grace_s)``, ``log_tail()`` and
``busy_ports(host, ports)``. The class is plain Python: tests use it directly without Ray;
``stage_host_actor`` wraps it as an actor in a given bundle.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from stagemesh_core import settings
from stagemesh_core.gpus import CUDA_VISIBLE_DEVICES, node_gpu_count
from stagemesh_core.memory import NodeMemory
from stagemesh_core.ports import port_is_free
from stagemesh_core.settings import MLX_RESOURCE
from stagemesh_core.states import ExitCode

HOST_IP_ENV = settings.env_name("HOST_IP")
DEFAULT_STAGE_COMMAND = ("-m", "stage_worker")
NODE_PROBE_COMMAND = ("-m", "stage_worker.service.node_probe")
_NODE_PROBE_S = 60.0  # importing MLX; a GPU's first query may take a few seconds
ACTOR_NUM_CPUS = 0.01  # Ray bookkeeping only; actors ask for 1 CPU unless told

# Linux: the stage gets SIGTERM if the actor process dies (killed by Ray, node
# shutdown), so no orphan keeps its ring and gRPC ports. PDEATHSIG survives
# exec; the ppid check closes the race where the parent died before prctl.
_PDEATHSIG_SHIM = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)\n"
    f"if os.getppid() != int(sys.argv[1]): sys.exit({int(ExitCode.ORPHANED)})\n"
    "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])\n"
)


class StageHostError(RuntimeError):
    """A StageHost cannot do what was asked; the message says why."""


@dataclass(frozen=True)
class HostInfo:
    node_id: str
    host: str  # address to advertise for ring and gRPC
    host_source: str  # "STAGEMESH_HOST_IP" or "ray node address"
    hostname: str
    pid: int  # the actor's own pid
    python: str
    mlx: str | None
    stagemesh: str | None
    platform: str
    gpu_count: int = 0  # NVIDIA GPUs the node's stages are spread over; 0: none to assign (Metal, CPU)


def advertised_host(node_id: str, env: Mapping[str, str], nodes: Sequence[Mapping]) -> tuple[str, str]:
    """(address, source): ``STAGEMESH_HOST_IP`` when set, else this node's Ray address.

    ``nodes`` is ``ray.nodes()``; the node's ``NodeManagerAddress`` is what it
    was started with (``ray start --node-ip-address`` / ``_node_ip_address``).
    """
    pinned = env.get(HOST_IP_ENV, "").strip()
    if pinned:
        return pinned, HOST_IP_ENV
    for node in nodes:
        if node.get("NodeID") == node_id and node.get("Alive", node.get("alive", True)):
            address = node.get("NodeManagerAddress")
            if address:
                return str(address), "ray node address"
    raise StageHostError(
        f"node {node_id} is not among Ray's live nodes; set {HOST_IP_ENV} on it "
        f"to the address its peers should use"
    )


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def nvidia_smi_list(env: Mapping[str, str]) -> str | None:
    """``nvidia-smi -L``'s output, or None where there is no NVIDIA driver; not run when
    ``CUDA_VISIBLE_DEVICES`` already says which GPUs the node's stages may use."""
    if CUDA_VISIBLE_DEVICES in env:
        return None
    try:
        done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def stage_env(base: Mapping[str, str]) -> dict[str, str]:
    """The stage's environment: the node's, minus what Ray forced on its worker."""
    env = dict(base)
    # Ray pins OMP_NUM_THREADS=1 in workers holding less than one CPU; our 0.01
    # CPU is bookkeeping, so the stage keeps the node's own threading defaults.
    if env.get("OMP_NUM_THREADS") == "1":
        env.pop("OMP_NUM_THREADS")
    env["PYTHONUNBUFFERED"] = "1"
    return env


class StageHost:
    """Owns at most one stage process at a time; every method returns quickly."""

    def __init__(self, label: str = "stage") -> None:
        self._label = label
        self._workdir = Path(tempfile.mkdtemp(prefix=f"stagemesh-{label}-"))
        self._process: subprocess.Popen | None = None
        self._log_path: Path | None = None
        self._starts = 0
        self._gpu_count: int | None = None  # counted once: a node's GPUs do not change under it
        self._memory: NodeMemory | None = None  # likewise its memory and backend

    # -- identity -------------------------------------------------------------

    def describe(self) -> HostInfo:
        """``HostInfo``: the node id, the address the stage must advertise, versions and GPU count.

        The address is ``STAGEMESH_HOST_IP`` from this node's environment, else the address the node registered
        with Ray (``advertised_host``); never ``ray.util.get_node_ip_address()``, which names the outward
        interface even for a node started on 127.0.0.1. The GPUs are those its stages may be spread over
        (``stagemesh_core.gpus``: the entries of ``CUDA_VISIBLE_DEVICES``, else ``nvidia-smi -L``'s GPUs; 0 on
        a Mac or a CPU node)."""
        import ray  # only inside an actor; plain use (tests) goes through describe_local

        node_id = ray.get_runtime_context().get_node_id()
        return self.describe_local(node_id, ray.nodes())

    def describe_local(self, node_id: str, nodes: Sequence[Mapping]) -> HostInfo:
        host, source = advertised_host(node_id, os.environ, nodes)
        if self._gpu_count is None:
            self._gpu_count = node_gpu_count(os.environ, nvidia_smi_list(os.environ))
        return HostInfo(
            node_id=node_id, host=host, host_source=source, hostname=socket.gethostname(),
            pid=os.getpid(), python=platform.python_version(), mlx=_version("mlx"),
            stagemesh=_version("stagemesh"), platform=f"{sys.platform}-{platform.machine()}",
            gpu_count=self._gpu_count,
        )

    def node_memory(self, command: Sequence[str] = NODE_PROBE_COMMAND) -> NodeMemory:
        """This node's memory and backend as a stage here sees them, for the layer planner.

        MLX's recommended working set on Metal, the GPU's memory on CUDA, the host's on the CPU, and
        ``STAGEMESH_NODE_MEMORY`` / ``STAGEMESH_NODE_SPEED``. Read by ``python -m stage_worker.service.node_probe`` in a
        subprocess: the coordinator may not import the stage worker, and the subprocess has the environment and
        MLX a stage started here has. Asked once, then cached."""
        if self._memory is None:
            try:
                done = subprocess.run([sys.executable, *command], capture_output=True, text=True,
                                      timeout=_NODE_PROBE_S, env=stage_env(os.environ), stdin=subprocess.DEVNULL)
            except (OSError, subprocess.SubprocessError) as exc:
                raise StageHostError(f"{self._label}: could not read this node's memory ({exc})") from exc
            lines = done.stdout.strip().splitlines()
            if done.returncode != 0 or not lines:
                raise StageHostError(f"{self._label}: reading this node's memory failed (exit {done.returncode}): "
                                     f"{done.stderr.strip()[-500:]}")
            self._memory = NodeMemory.from_dict(json.loads(lines[-1]))
        return self._memory

    # -- the stage process ----------------------------------------------------

    def start(self, launch_json: str, command: Sequence[str] = DEFAULT_STAGE_COMMAND) -> int:
        """Start ``python <command> --launch FILE`` (``launch_json``, a ``StageLaunch``); returns its pid."""
        if self._process is not None and self._process.poll() is None:
            raise StageHostError(
                f"{self._label}: stage pid {self._process.pid} is still running; stop it first"
            )
        self._starts += 1
        launch_path = self._workdir / "launch.json"
        # The launch carries the mesh token: readable by this user only (the directory is 0700 too).
        launch_path.touch(mode=0o600)
        launch_path.chmod(0o600)
        launch_path.write_text(launch_json)
        self._log_path = self._workdir / f"stage-{self._starts}.log"
        argv = [*command, "--launch", str(launch_path)]
        if sys.platform.startswith("linux"):
            argv = ["-c", _PDEATHSIG_SHIM, str(os.getpid()), *argv]
        with open(self._log_path, "wb") as log:
            self._process = subprocess.Popen(
                [sys.executable, *argv], stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, cwd=self._workdir, env=stage_env(os.environ),
                start_new_session=True,  # a Ctrl-C at the driver's terminal is the coordinator's to handle
            )
        return self._process.pid

    def poll(self) -> int | None:
        """The stage's exit code, or None while it runs (or before any start)."""
        return None if self._process is None else self._process.poll()

    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def terminate(self) -> None:
        """SIGTERM the stage, without waiting (the entry stage then stops its pipeline)."""
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGTERM)

    def wait(self, timeout_s: float) -> int | None:
        """Wait up to ``timeout_s`` for the stage to exit; its exit code or None."""
        if self._process is None:
            return None
        try:
            return self._process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, grace_s: float = 5.0) -> int | None:
        """SIGTERM, wait ``grace_s``, then SIGKILL; returns the exit code (None if never started)."""
        process = self._process
        if process is None:
            return None
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(grace_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        return process.returncode

    def log_path(self) -> str | None:
        return None if self._log_path is None else str(self._log_path)

    def log_tail(self, lines: int = 20) -> str:
        if self._log_path is None:
            return ""
        try:
            text = self._log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    # -- ports ----------------------------------------------------------------

    def busy_ports(self, host: str, ports: Sequence[int]) -> list[int]:
        """Which of ``ports`` cannot be bound on this node right now (a restart waits for its old ports)."""
        return busy_ports(host, ports)


def busy_ports(host: str, ports: Sequence[int]) -> list[int]:
    """Ports of ``ports`` that cannot be bound on ``host`` now (see ``ports.port_is_free``)."""
    return [port for port in ports if not port_is_free(host, port)]


def wait_ports_free(host: str, ports: Sequence[int], timeout_s: float, poll_s: float = 0.2) -> list[int]:
    """Wait until every port is bindable; returns the ones still busy at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        busy = busy_ports(host, ports)
        if not busy or time.monotonic() >= deadline:
            return busy
        time.sleep(poll_s)


def stage_host_actor(placement_group, bundle_index: int, label: str, name: str | None = None):
    """Create a ``StageHost`` actor in bundle ``bundle_index`` of ``placement_group``."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


    actor_class = ray.remote(StageHost)
    return actor_class.options(
        num_cpus=ACTOR_NUM_CPUS,
        resources={MLX_RESOURCE: 1},
        max_restarts=0,  # a lost host means re-placing its replica, not a silent restart
        name=name,
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=placement_group, placement_group_bundle_index=bundle_index,
        ),
    ).remote(label)


def node_probe_actor(node_id: str, label: str):
    """A ``StageHost`` pinned to node ``node_id`` that holds no ``mlx`` unit: it only answers ``describe`` and
    ``node_memory`` (``stagemesh plan``), so a mesh already serving on that node is not disturbed."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return ray.remote(StageHost).options(
        num_cpus=ACTOR_NUM_CPUS, max_restarts=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
    ).remote(label)
