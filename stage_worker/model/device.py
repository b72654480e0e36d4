"""The device a stage computes on: MLX's backend, a name a person recognises, and its memory.

Three backends: ``cpu`` (MLX's CPU backend: the Linux CPU wheel, or no GPU), ``metal`` (Apple GPUs) and
``cuda`` (NVIDIA GPUs through the ``mlx-cuda`` wheels). Deciding is pure: ``describe`` turns raw
``DeviceFacts`` into a ``StageDevice``, so every backend's rules are tested on any machine; ``probe`` gathers
the facts at the edge and never raises for a missing GPU. A stage's memory budget comes from
``StageDevice.memory_bytes`` on a GPU and from the host's memory on the CPU (``stage_worker.service.memory``).
``apply_wired_limit`` keeps a Metal stage's working set resident, as ``mlx_lm.server`` does; the CPU and CUDA
skip it. MLX is imported only by the functions that query it.
"""

from __future__ import annotations

import platform
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from stagemesh_core.gpus import visible_devices

BACKENDS = ("cpu", "metal", "cuda")
_MIB = 1024 * 1024
_SMI_TIMEOUT_S = 10.0

T = TypeVar("T")


@dataclass(frozen=True)
class DeviceFacts:
    """What MLX and the machine say, unjudged."""

    default_device: str  # MLX's default device type: "gpu" or "cpu"
    metal_available: bool
    cuda_available: bool
    gpu_info: Mapping[str, str | int] = field(default_factory=dict)  # mx.device_info(gpu); {} without one
    cpu_model: str = ""  # /proc/cpuinfo's model name, else MLX's CPU device name, else the machine type
    smi_name: str | None = None  # nvidia-smi's name of the stage's GPU (asked only when MLX does not say)
    smi_memory_bytes: int | None = None  # nvidia-smi's memory.total of that GPU (likewise)


@dataclass(frozen=True)
class StageDevice:
    """The backend a stage computes on, the device's name and the memory its budget comes from."""

    backend: str  # cpu, metal or cuda
    name: str  # "Apple M2 Max (applegpu_g14s)", "NVIDIA H200", "AMD EPYC 7763 64-Core Processor"
    memory_bytes: int | None = None  # GPU memory a stage may use; None on the CPU (host memory applies)
    free_bytes: int | None = None  # CUDA: the device's free memory when MLX says

    @property
    def on_gpu(self) -> bool:
        return self.backend != "cpu"

    def summary(self) -> str:
        """``cuda NVIDIA H200 (150.1 GB)``: the backend, the name, the memory when known."""
        memory = f" ({self.memory_bytes / 1e9:.1f} GB)" if self.memory_bytes else ""
        return f"{self.backend} {self.name}{memory}"


# -- decisions (pure) ----------------------------------------------------------------------


def backend_of(default_device: str, metal_available: bool, cuda_available: bool) -> str:
    """``cpu`` unless MLX computes on a GPU by default; a GPU that is not Metal is CUDA (MLX has no other: on the
    ``mlx-cuda`` wheels the default device is ``gpu`` while ``mx.metal.is_available()`` is False)."""
    if default_device != "gpu":
        return "cpu"
    if cuda_available or not metal_available:
        return "cuda"
    return "metal"


def _text(info: Mapping[str, str | int], key: str) -> str:
    value = info.get(key)
    return value.strip() if isinstance(value, str) else ""


def _bytes(info: Mapping[str, str | int], key: str) -> int | None:
    value = info.get(key)
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def device_name(facts: DeviceFacts, backend: str) -> str:
    """A name a person recognises; Metal adds the GPU's architecture (``applegpu_g14s``) to the chip's name."""
    if backend == "cpu":
        return facts.cpu_model or "cpu"
    name, arch = _text(facts.gpu_info, "device_name"), _text(facts.gpu_info, "architecture")
    if backend == "metal":
        if name and arch and arch != name:
            return f"{name} ({arch})"
        return name or arch or "Apple GPU"
    return name or facts.smi_name or "NVIDIA GPU"


def device_memory(facts: DeviceFacts, backend: str) -> int | None:
    """Bytes a stage's budget comes from: Metal's recommended working set (what the GPU may keep wired,
    below the unified memory's size), CUDA's total device memory; None on the CPU."""
    if backend == "metal":
        return _bytes(facts.gpu_info, "max_recommended_working_set_size") or _bytes(facts.gpu_info, "memory_size")
    if backend == "cuda":
        return _bytes(facts.gpu_info, "total_memory") or _bytes(facts.gpu_info, "memory_size") \
            or facts.smi_memory_bytes
    return None


def describe(facts: DeviceFacts) -> StageDevice:
    """The stage's device from the raw facts (pure)."""
    backend = backend_of(facts.default_device, facts.metal_available, facts.cuda_available)
    free = _bytes(facts.gpu_info, "free_memory") if backend == "cuda" else None
    return StageDevice(backend, device_name(facts, backend), device_memory(facts, backend), free)


def needs_nvidia_smi(backend: str, gpu_info: Mapping[str, str | int]) -> bool:
    """Whether MLX left the CUDA device's name or memory unsaid (older MLX has no ``mx.device_info``)."""
    return backend == "cuda" and not (_text(gpu_info, "device_name") and _bytes(gpu_info, "total_memory"))


def cpu_model_name(cpuinfo: str | None) -> str:
    """The CPU's model from ``/proc/cpuinfo`` (x86: ``model name``; some Arm boards: ``Model``), or ""."""
    for key in ("model name", "Model", "Hardware"):
        for line in (cpuinfo or "").splitlines():
            name, sep, value = line.partition(":")
            if sep and name.strip() == key and value.strip():
                return value.strip()
    return ""


def smi_device_id(env: Mapping[str, str]) -> str:
    """The ``nvidia-smi -i`` id of MLX's device 0: nvidia-smi ignores ``CUDA_VISIBLE_DEVICES``, so its first
    entry (an index or a UUID, both accepted by ``-i``) names the GPU; unset, it is physical GPU 0."""
    visible = visible_devices(env)
    return visible[0] if visible else "0"


def parse_nvidia_smi_query(output: str | None) -> tuple[str | None, int | None]:
    """(name, total bytes) from ``nvidia-smi --query-gpu=name,memory.total --format=csv,noheader,nounits``."""
    line = (output or "").strip().splitlines()[0] if (output or "").strip() else ""
    name, sep, memory = line.rpartition(",")
    if not sep:
        return None, None
    try:
        total = int(float(memory.strip()) * _MIB)  # MiB
    except ValueError:
        total = None
    return name.strip() or None, total


def wired_limit(device: StageDevice) -> int | None:
    """The wired limit a stage sets: Metal's recommended working set (``mlx_lm.server`` does the same), so
    weights and KV stay resident; None elsewhere (the CPU has no wired memory, CUDA has its own memory)."""
    return device.memory_bytes if device.backend == "metal" else None


# -- the edge: asking MLX and the machine --------------------------------------------------------


def _safe(query: Callable[[], T], default: T) -> T:
    """A query that may fail on some build (no such function, no driver) answers ``default``."""
    try:
        return query()
    except Exception:
        return default


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _mlx_device_info(mx: Any, device: Any) -> dict[str, str | int]:
    if hasattr(mx, "device_info"):
        return dict(_safe(lambda: mx.device_info(device), {}))
    if device == mx.gpu and _safe(lambda: bool(mx.metal.is_available()), False):
        return dict(_safe(mx.metal.device_info, {}))  # MLX before mx.device_info
    return {}


def nvidia_smi(args: list[str]) -> str | None:
    """``nvidia-smi ARGS``' output, or None where there is no NVIDIA driver (or it fails)."""
    try:
        done = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=_SMI_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def _backend_facts(mx: Any) -> tuple[str, bool, bool]:
    """(default device type, Metal available, CUDA available) as MLX reports them."""
    default = "gpu" if mx.default_device() == mx.gpu else "cpu"
    metal = _safe(lambda: bool(mx.metal.is_available()), False)
    cuda = _safe(lambda: bool(mx.cuda.is_available()), False)  # mx.cuda: MLX 0.29 on
    return default, metal, cuda


def current_backend() -> str:
    """This process's MLX backend, cheaply (no device query)."""
    import mlx.core as mx

    return backend_of(*_backend_facts(mx))


def probe(env: Mapping[str, str] | None = None) -> StageDevice:
    """The device this process's MLX computes on; never raises for a missing GPU.

    The facts come from MLX's own ``mx.device_info`` (Metal: ``device_name``, ``architecture``,
    ``max_recommended_working_set_size``; CUDA: ``device_name``, ``total_memory``, ``free_memory``),
    ``nvidia-smi`` only when MLX does not say, and ``/proc/cpuinfo`` for the CPU's model.
    """
    import os

    import mlx.core as mx

    env = os.environ if env is None else env
    default, metal, cuda = _backend_facts(mx)
    backend = backend_of(default, metal, cuda)
    gpu_info = _mlx_device_info(mx, mx.gpu) if backend != "cpu" else {}
    smi_name, smi_memory = None, None
    if needs_nvidia_smi(backend, gpu_info):
        smi_name, smi_memory = parse_nvidia_smi_query(nvidia_smi(
            ["--query-gpu=name,memory.total", "--format=csv,noheader,nounits", "-i", smi_device_id(env)]))
    cpu_model = cpu_model_name(_read("/proc/cpuinfo")) or _text(_mlx_device_info(mx, mx.cpu), "device_name") \
        or platform.processor() or platform.machine()
    return describe(DeviceFacts(default, metal, cuda, gpu_info, cpu_model, smi_name, smi_memory))


def apply_wired_limit(device: StageDevice) -> int | None:
    """Set MLX's wired limit on Metal (see ``wired_limit``); the limit set, or None where it does not apply
    or the system refuses it (macOS before 15, a limit above ``iogpu.wired_limit_mb``)."""
    limit = wired_limit(device)
    if limit is None:
        return None
    import mlx.core as mx

    try:
        mx.set_wired_limit(limit)
    except (RuntimeError, ValueError):
        return None
    return limit


def memory_limit_for(backend: str, budget_bytes: int) -> int | None:
    """The limit MLX's allocator keeps this stage under (pure): its memory budget on a GPU backend, None on the
    CPU. A GPU's memory is not paged: MLX's allocator keeps freed buffers for reuse, by default up to most of the
    whole GPU (CUDA: 0.8 of it; Metal: 1.5x the recommended working set), so two servers or stages sharing a GPU,
    each within its ``--memory-fraction`` share, could still starve each other into out-of-memory errors. Under
    the limit, MLX returns what it keeps before it would go past its share. On the CPU the host pages memory and
    the budget stays a planning figure."""
    return budget_bytes if backend in ("cuda", "metal") and budget_bytes > 0 else None


def apply_memory_limit(backend: str, budget_bytes: int) -> int | None:
    """Set MLX's memory limit and its buffer cache's to ``memory_limit_for``; the limit set, or None where none
    applies."""
    limit = memory_limit_for(backend, budget_bytes)
    if limit is None:
        return None
    import mlx.core as mx

    mx.set_memory_limit(limit)
    mx.set_cache_limit(limit)
    return limit
