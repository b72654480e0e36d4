"""Mixture-of-experts blocks computed the way that suits the rows of a step: per routed pair, or every expert.

Contract:
* mlx-lm's ``SwitchGLU`` (the experts of qwen3_moe, mixtral, gpt_oss, deepseek_v3, glm4_moe, olmoe, ...)
  computes each (row, expert) pair its router picked with gathered matmuls (``mx.gather_mm``).
  ``all_experts_glu(block, x, indices)`` computes the same block as every expert on every row and then takes
  the picked pairs; it returns what ``SwitchGLU.__call__`` returns, in its shape, equal but for the last bits.
* ``ExpertsPolicy(all_experts_max_rows)`` says which form a block call takes; ``policy_for(setting, backend)``
  decides it from ``STAGEMESH_ALL_EXPERTS_ROWS`` (pure).
* ``install(module, policy)`` makes every unquantized ``SwitchGLU`` in a loaded model follow ``policy`` and
  returns how many it changed. Its class becomes ``RoutedSwitchGLU``, a subclass whose ``__call__`` chooses;
  its parameters, their names and its bytes are unchanged. Quantized experts stay gathered (``gather_qmm``):
  the all-experts form is for dense weights only.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import SwitchGLU, SwitchLinear

from stage_worker.model.sibling_projections import joined_experts
from stagemesh_core import settings

# mlx-lm's SwitchGLU sorts a call's (row, expert) pairs by expert from this many on (``do_sort``).
SORTED_PAIRS = 64
# On CUDA, the rows up to which every expert beats the sorted gathered form for Qwen3-30B-A3B's and gpt-oss-20b's
# blocks (docs/performance.md has the figures, ``stagemesh bench experts``): every decode step and, at the
# default 512-row budget, every prompt chunk. Elsewhere unmeasured, so mlx-lm's gathered form.
CUDA_ALL_EXPERTS_MAX_ROWS = 512


@dataclass(frozen=True)
class ExpertsPolicy:
    """How a stage's expert blocks run: every expert on a call of at most ``all_experts_max_rows`` rows and at
    least ``all_experts_min_pairs`` routed pairs (by default those mlx-lm would sort), else gathered (0 rows:
    always gathered, mlx-lm as it is).

    A gathered matmul reads only the experts the rows picked, the least memory a call can read. Below
    ``SORTED_PAIRS`` pairs mlx-lm gathers them unsorted, and on CUDA that is fastest (a decode step of one to a
    few sequences). From there on mlx-lm sorts the pairs by expert first, and MLX's CUDA kernels for sorted
    gathers run far below the memory bandwidth, while one wide matmul over every expert runs near it: by then
    the rows pick most experts anyway (16 rows of 8 of 128 experts touch about 82; 16 rows of 4 of 32, about
    28), so reading all of them costs little more than reading the picked ones, and the compute it adds is
    small beside a GPU's. With many rows (a long prompt) that compute grows with the rows: hence a row limit.
    """

    all_experts_max_rows: int
    all_experts_min_pairs: int = SORTED_PAIRS

    def all_experts(self, rows: int, pairs: int) -> bool:
        return pairs >= self.all_experts_min_pairs and rows <= self.all_experts_max_rows


GATHERED = ExpertsPolicy(all_experts_max_rows=0)


def policy_for(setting: str, backend: str) -> ExpertsPolicy:
    """``STAGEMESH_ALL_EXPERTS_ROWS`` on ``backend`` (pure): ``auto`` (CUDA: ``CUDA_ALL_EXPERTS_MAX_ROWS``,
    elsewhere gathered), ``off`` (gathered), or a row count (0 is off)."""
    if setting == "auto":
        return ExpertsPolicy(CUDA_ALL_EXPERTS_MAX_ROWS) if backend == "cuda" else GATHERED
    if setting == "off":
        return GATHERED
    try:
        rows = int(setting)
    except ValueError:
        rows = -1
    if rows < 0:
        raise ValueError(f"{settings.env_name('ALL_EXPERTS_ROWS')} must be auto, off or a row count (0 or more), "
                         f"got {setting!r}")
    return ExpertsPolicy(rows)


class RoutedSwitchGLU(SwitchGLU):
    """mlx-lm's ``SwitchGLU``, run as every expert on every row where its policy says so (``install``)."""

    _experts_policy: ExpertsPolicy = GATHERED

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        if self._experts_policy.all_experts(indices.size // indices.shape[-1], indices.size):
            return all_experts_glu(self, x, indices)
        return super().__call__(x, indices)


def install(module: nn.Module, policy: ExpertsPolicy) -> int:
    """Make every unquantized ``SwitchGLU`` under ``module`` follow ``policy``; the number changed."""
    changed = 0
    for _, block in module.named_modules():
        if not isinstance(block, SwitchGLU) or not _dense(block):
            continue
        # A class change rather than a wrapper: the model's own code calls the block where it is, and its
        # parameters keep their names (the planner and the weight checks count them by name).
        block.__class__ = RoutedSwitchGLU
        block._experts_policy = policy
        changed += 1
    return changed


def _dense(block: SwitchGLU) -> bool:
    joined = joined_experts(block)
    gate_up = (joined,) if joined is not None else (block.gate_proj, block.up_proj)
    return all(type(p) is SwitchLinear for p in (*gate_up, block.down_proj))


def all_experts_glu(block: SwitchGLU, x: mx.array, indices: mx.array) -> mx.array:
    """``block(x, indices)`` computed as every expert on every row, then the picked pairs.

    The gate and up projections of all experts run as one ``[rows, experts * hidden]`` matmul each (one for
    both where ``sibling_projections`` joined them), the down projection as one matmul batched over the
    experts. The result has ``SwitchGLU.__call__``'s shape (``[..., k, dims]``); each output element is the
    same dot product, which a GEMM library may block differently, so values can differ from the gathered form
    in the last bits.
    """
    *lead, dims = x.shape
    k = indices.shape[-1]
    rows = x.reshape(-1, dims)
    joined = joined_experts(block)
    if joined is not None:  # gate and up joined (``sibling_projections``): one matmul for both
        gate_up = _every_expert(joined, rows)
        half = gate_up.shape[-1] // 2
        gate, up = gate_up[..., :half], gate_up[..., half:]
    else:
        up = _every_expert(block.up_proj, rows)
        gate = _every_expert(block.gate_proj, rows)
    hidden = block.activation(up, gate).swapaxes(0, 1)  # [experts, rows, hidden]
    down = block.down_proj
    out = hidden @ down["weight"].swapaxes(-1, -2)  # [experts, rows, dims]: one matmul batched over the experts
    if "bias" in down:
        out = out + mx.expand_dims(down["bias"], -2)
    picked = mx.take_along_axis(out.swapaxes(0, 1), indices.reshape(-1, k, 1), axis=1)  # [rows, k, dims]
    return picked.reshape(*lead, k, dims)


def _every_expert(linear: nn.Module, rows: mx.array) -> mx.array:
    """``[rows, in]`` through every expert of ``linear``: ``[rows, experts, out]``, as one matmul."""
    weight = linear["weight"]  # [experts, out, in]: the experts' rows one after another, a plain linear layer's
    experts, out, dims = weight.shape
    y = rows @ weight.reshape(experts * out, dims).T
    if "bias" in linear:
        y = y + linear["bias"].reshape(experts * out)
    return y.reshape(-1, experts, out)


__all__ = ["CUDA_ALL_EXPERTS_MAX_ROWS", "GATHERED", "SORTED_PAIRS", "ExpertsPolicy", "RoutedSwitchGLU",
           "all_experts_glu", "install", "policy_for"]
