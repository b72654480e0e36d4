"""Memory of a stage: its peak resident set, its budget (host or GPU memory), and its KV capacity.

Peak resident memory is measured the way that survives ``exec``.

On Linux ``getrusage(...).ru_maxrss`` carries the parent's high-water mark
across fork + exec, so a stage started by a large parent would report the
parent's peak; ``VmHWM`` in ``/proc/self/status`` belongs to this process image
alone. macOS has no /proc and reports ``ru_maxrss`` in bytes.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass


def peak_rss_bytes() -> int:
    if sys.platform.startswith("linux"):
        try:
            with open("/proc/self/status") as status:
                for line in status:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


# What a stage process needs beyond weights and KV: Python, MLX, mlx-lm (which imports
# transformers), gRPC, ring buffers, activations of one batch. Measured ~120-200 MB here.
RUNTIME_OVERHEAD_BYTES = 256 * 1024 * 1024


class MemoryBudgetError(ValueError):
    """The stage cannot hold its weights plus one full-length sequence's KV; says what to change."""


@dataclass(frozen=True)
class MemoryBudget:
    """This stage's share of the memory it computes in (``--memory-fraction`` of the total, split
    evenly between the stages sharing it, so co-located stages do not oversubscribe it): the host's
    memory on the CPU, the GPU's on Metal and CUDA."""

    total_bytes: int
    available_bytes: int
    fraction: float
    stages_on_host: int  # stages sharing this memory (on a GPU: the stages on that GPU)
    memory: str = "host"  # whose memory: "host" or "GPU", for messages

    @property
    def budget_bytes(self) -> int:
        return int(self.total_bytes * self.fraction / max(1, self.stages_on_host))


def budget_for(fraction: float, stages: int, *, host_total: int, host_available: int, backend: str = "cpu",
               device_total: int | None = None, device_free: int | None = None) -> MemoryBudget:
    """The stage's budget from the raw numbers (pure): a GPU's memory when the backend is one and its size
    is known (Metal: the recommended working set, whose memory is the host's unified memory, so the host's
    free memory still bounds it; CUDA: the device's memory and its free memory when known), else the host's."""
    if not 0 < fraction <= 1:
        raise MemoryBudgetError(f"--memory-fraction must be in (0, 1], got {fraction}")
    if backend == "metal" and device_total:
        return MemoryBudget(device_total, min(host_available, device_total), fraction, stages, "GPU")
    if backend == "cuda" and device_total:
        free = device_free if device_free is not None else device_total
        return MemoryBudget(device_total, free, fraction, stages, "GPU")
    return MemoryBudget(host_total, host_available, fraction, stages)


def stages_sharing_memory(backend: str, stages_on_host: int, stages_on_gpu: int, own_gpu: bool) -> int:
    """Stages whose budgets split this stage's memory (pure): on CUDA with a GPU of its own (the
    coordinator's ``gpu_index``), those given the same GPU; otherwise every stage on the host (a Mac's
    one GPU, the host's memory, or CUDA GPUs left to the node's environment)."""
    if backend == "cuda" and own_gpu and stages_on_gpu > 0:
        return stages_on_gpu
    return stages_on_host


def host_memory_budget(fraction: float, stages_on_host: int, backend: str = "cpu",
                       device_total: int | None = None, device_free: int | None = None) -> MemoryBudget:
    """``budget_for`` with this host's memory (psutil); pass the GPU's numbers on Metal and CUDA."""
    import psutil

    memory = psutil.virtual_memory()
    return budget_for(fraction, stages_on_host, host_total=memory.total, host_available=memory.available,
                      backend=backend, device_total=device_total, device_free=device_free)


def kv_bytes_per_token(local_layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Keys and values of one token across this stage's layers."""
    return local_layers * 2 * kv_heads * head_dim * dtype_bytes


def kv_token_capacity(budget: MemoryBudget, weight_bytes: int, per_token: int, max_model_len: int,
                      stage: str) -> int:
    """Tokens of KV this stage can hold; refuses a budget that cannot hold one full sequence (pure)."""
    room = budget.budget_bytes - weight_bytes - RUNTIME_OVERHEAD_BYTES
    capacity = max(0, room // per_token)
    need = max_model_len * per_token
    if capacity < max_model_len:
        raise MemoryBudgetError(
            f"{stage}: one sequence of --max-model-len {max_model_len} needs {need / 1e6:.0f} MB of KV cache, but "
            f"its budget ({budget.fraction:g} x {budget.total_bytes / 1e9:.1f} GB / {budget.stages_on_host} "
            f"stage(s) on this {budget.memory} = {budget.budget_bytes / 1e6:.0f} MB, minus {weight_bytes / 1e6:.0f} "
            f"MB of weights and {RUNTIME_OVERHEAD_BYTES / 1e6:.0f} MB of runtime) leaves {max(room, 0) / 1e6:.0f} MB; "
            f"lower --max-model-len, raise --memory-fraction, or spread the model over more stages (-pp)"
        )
    if budget.available_bytes < weight_bytes + need:
        raise MemoryBudgetError(
            f"{stage}: the {budget.memory} has only {budget.available_bytes / 1e6:.0f} MB free, less than the weights "
            f"({weight_bytes / 1e6:.0f} MB) plus one --max-model-len {max_model_len} sequence of KV "
            f"({need / 1e6:.0f} MB); free memory or lower --max-model-len"
        )
    return int(capacity)
