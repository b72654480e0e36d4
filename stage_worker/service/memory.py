"""Memory of a stage: its peak resident set, its budget (host or GPU memory), and its KV capacity.

The budget rule itself lives in ``stagemesh_core.memory``, shared with the layer planner.

Peak resident memory is measured the way that survives ``exec``.

On Linux ``getrusage(...).ru_maxrss`` carries the parent's high-water mark
across fork + exec, so a stage started by a large parent would report the
parent's peak; ``VmHWM`` in ``/proc/self/status`` belongs to this process image
alone. macOS has no /proc and reports ``ru_maxrss`` in bytes.
"""

from __future__ import annotations

import resource
import sys

from stagemesh_core import settings

# The budget rule and the runtime allowance are the layer planner's too: one home, the core.
from stagemesh_core.memory import (
    RUNTIME_OVERHEAD_BYTES,
    MemoryBudget,
    MemoryBudgetError,
    StageKV,
    budget_for,
    kv_bytes_per_token,
    kv_capacity_tokens,
    stages_sharing_memory,
)

__all__ = ["RUNTIME_OVERHEAD_BYTES", "MemoryBudget", "MemoryBudgetError", "budget_for", "host_memory_budget",
           "kv_bytes_per_token", "kv_token_capacity", "peak_rss_bytes", "stages_sharing_memory"]


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


def host_memory_budget(fraction: float, stages_on_host: int, backend: str = "cpu",
                       device_total: int | None = None, device_free: int | None = None) -> MemoryBudget:
    """``budget_for`` with this host's memory (psutil) and its ``STAGEMESH_NODE_MEMORY`` cap; pass the GPU's
    numbers on Metal and CUDA."""
    import psutil

    memory = psutil.virtual_memory()
    return budget_for(fraction, stages_on_host, host_total=memory.total, host_available=memory.available,
                      backend=backend, device_total=device_total, device_free=device_free,
                      cap=settings.NODE_MEMORY)


def kv_token_capacity(budget: MemoryBudget, weight_bytes: int, kv: StageKV, element_bytes: int,
                      max_num_seqs: int, max_model_len: int, stage: str) -> int:
    """Token positions of KV this stage holds (``kv_capacity_tokens``, as the planner counts them); refuses a
    budget that cannot hold one full sequence (pure)."""
    room = budget.budget_bytes - weight_bytes - RUNTIME_OVERHEAD_BYTES
    capacity = kv_capacity_tokens(room, kv, element_bytes, max_num_seqs, max_model_len)
    need = kv.reserved_bytes(max_model_len, element_bytes, max_num_seqs)
    if capacity < max_model_len:
        bounded = need > kv.reserved_bytes(max_model_len, element_bytes, 1)
        per_sequence = (f" (with the sliding windows and recurrent state of --max-num-seqs {max_num_seqs} "
                        f"sequences)") if bounded else ""
        raise MemoryBudgetError(
            f"{stage}: one sequence of --max-model-len {max_model_len} needs {need / 1e6:.0f} MB of KV cache"
            f"{per_sequence}, but "
            f"its budget ({budget.fraction:g} x {budget.total_bytes / 1e9:.1f} GB / {budget.stages_on_host} "
            f"stage(s) on this {budget.memory} = {budget.budget_bytes / 1e6:.0f} MB, minus {weight_bytes / 1e6:.0f} "
            f"MB of weights and {RUNTIME_OVERHEAD_BYTES / 1e6:.0f} MB of runtime) leaves {max(room, 0) / 1e6:.0f} MB; "
            f"lower --max-model-len{', --max-num-seqs' if bounded else ''}, raise --memory-fraction, or spread the "
            f"model over more stages (-pp)"
        )
    if budget.available_bytes < weight_bytes + need:
        raise MemoryBudgetError(
            f"{stage}: the {budget.memory} has only {budget.available_bytes / 1e6:.0f} MB free, less than the weights "
            f"({weight_bytes / 1e6:.0f} MB) plus one --max-model-len {max_model_len} sequence of KV "
            f"({need / 1e6:.0f} MB); free memory or lower --max-model-len"
        )
    return int(capacity)
