"""Memory of a stage: its peak resident set, its budget on the host, and its KV capacity.

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
    """This stage's share of its host's memory (``--memory-fraction`` of the total, split evenly
    between the stages on the host, so co-located stages do not oversubscribe it)."""

    total_bytes: int
    available_bytes: int
    fraction: float
    stages_on_host: int

    @property
    def budget_bytes(self) -> int:
        return int(self.total_bytes * self.fraction / max(1, self.stages_on_host))


def host_memory_budget(fraction: float, stages_on_host: int) -> MemoryBudget:
    import psutil

    if not 0 < fraction <= 1:
        raise MemoryBudgetError(f"--memory-fraction must be in (0, 1], got {fraction}")
    memory = psutil.virtual_memory()
    return MemoryBudget(memory.total, memory.available, fraction, stages_on_host)


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
            f"stage(s) on this host = {budget.budget_bytes / 1e6:.0f} MB, minus {weight_bytes / 1e6:.0f} MB of "
            f"weights and {RUNTIME_OVERHEAD_BYTES / 1e6:.0f} MB of runtime) leaves {max(room, 0) / 1e6:.0f} MB; "
            f"lower --max-model-len, raise --memory-fraction, or spread the model over more stages (-pp)"
        )
    if budget.available_bytes < weight_bytes + need:
        raise MemoryBudgetError(
            f"{stage}: the host has only {budget.available_bytes / 1e6:.0f} MB free, less than the weights "
            f"({weight_bytes / 1e6:.0f} MB) plus one --max-model-len {max_model_len} sequence of KV "
            f"({need / 1e6:.0f} MB); free memory or lower --max-model-len"
        )
    return int(capacity)
