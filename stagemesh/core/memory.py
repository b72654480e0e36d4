"""Memory facts and rules that the layer planner (coordinator) and every stage (stage_worker) share.

One home for the rules both sides must apply identically, or a plan the
coordinator thinks fits would be refused by the stage that loads it:

- ``NodeMemory``: what a node says about itself, read where it runs (the
  StageHost asks ``python -m stage_worker.node_probe`` on its own node): MLX's
  backend, the device, the host's and the GPU's memory, the
  ``STAGEMESH_NODE_MEMORY`` cap and the ``STAGEMESH_NODE_SPEED`` hint.
- ``budget_for``: a stage's memory budget from those numbers (Metal: MLX's
  recommended working set; CUDA: the GPU's memory; CPU: the host's), times
  ``--memory-fraction``, split evenly between the stages sharing that memory.
- ``RUNTIME_OVERHEAD_BYTES``: what a stage process needs beyond weights and KV.
- ``ModelFacts``: a model's size as the planner needs it (bytes of one decoder
  layer, the embedding, the head, KV elements per token per layer), kept as
  packed bytes plus elements so each stage's compute dtype gives its bytes.
- ``AUTO_DTYPES`` / ``dtype_bytes``: the compute dtype ``--dtype auto`` picks per backend.

Pure standard library: the core must not load MLX, NumPy or Ray.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from stagemesh.core.errors import UserError

# What a stage process needs beyond weights and KV: Python, MLX, mlx-lm (which imports
# transformers), gRPC, ring buffers, activations of one batch: about 120-200 MB on Linux.
RUNTIME_OVERHEAD_BYTES = 256 * 1024 * 1024

# --dtype auto: the compute dtype each backend runs best (stage_worker.stage_model resolves names to MLX dtypes).
AUTO_DTYPES: Mapping[str, str] = {"cpu": "float32", "metal": "float16", "cuda": "bfloat16"}
DTYPE_BYTES: Mapping[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}


def resolved_dtype(compute_dtype: str, backend: str) -> str:
    """``--dtype`` with ``auto`` resolved for ``backend``."""
    return AUTO_DTYPES.get(backend, "float32") if compute_dtype == "auto" else compute_dtype


def dtype_bytes(compute_dtype: str, backend: str) -> int:
    """Bytes of one element in the dtype a stage on ``backend`` computes in; ``UserError`` for an unknown one."""
    name = resolved_dtype(compute_dtype, backend)
    try:
        return DTYPE_BYTES[name]
    except KeyError:
        raise UserError(f"--dtype {compute_dtype!r} is not supported; use auto, {', '.join(DTYPE_BYTES)}") from None


class MemoryBudgetError(UserError):
    """A stage cannot hold its weights plus one full-length sequence's KV; says what to change."""


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
               device_total: int | None = None, device_free: int | None = None,
               cap: int | None = None) -> MemoryBudget:
    """The stage's budget from the raw numbers (pure): a GPU's memory when the backend is one and its size
    is known (Metal: the recommended working set, whose memory is the host's unified memory, so the host's
    free memory still bounds it; CUDA: the device's memory and its free memory when known), else the host's.
    ``cap`` (``STAGEMESH_NODE_MEMORY``) bounds the memory counted, before the fraction applies."""
    if not 0 < fraction <= 1:
        raise MemoryBudgetError(f"--memory-fraction must be in (0, 1], got {fraction}")
    if backend == "metal" and device_total:
        budget = MemoryBudget(device_total, min(host_available, device_total), fraction, stages, "GPU")
    elif backend == "cuda" and device_total:
        free = device_free if device_free is not None else device_total
        budget = MemoryBudget(device_total, free, fraction, stages, "GPU")
    else:
        budget = MemoryBudget(host_total, host_available, fraction, stages)
    if cap is not None and cap < budget.total_bytes:
        budget = MemoryBudget(cap, min(cap, budget.available_bytes), fraction, stages, budget.memory)
    return budget


def stages_sharing_memory(backend: str, stages_on_host: int, stages_on_gpu: int, own_gpu: bool) -> int:
    """Stages whose budgets split this stage's memory (pure): on CUDA with a GPU of its own (the
    coordinator's ``gpu_index``), those given the same GPU; otherwise every stage on the host (a Mac's
    one GPU, the host's memory, or CUDA GPUs left to the node's environment)."""
    if backend == "cuda" and own_gpu and stages_on_gpu > 0:
        return stages_on_gpu
    return stages_on_host


@dataclass(frozen=True)
class NodeMemory:
    """What one node says about its memory and backend, read on that node (see the module docstring)."""

    backend: str  # cpu, metal or cuda
    device: str  # the device's name
    host_total: int
    host_available: int
    device_total: int | None = None  # Metal: recommended working set; CUDA: the GPU's memory; None on the CPU
    device_free: int | None = None  # CUDA: the GPU's free memory when MLX says
    cap: int | None = None  # STAGEMESH_NODE_MEMORY on that node
    speed: float = 1.0  # STAGEMESH_NODE_SPEED on that node: relative speed, 1 when unknown

    def budget(self, fraction: float, stages: int) -> MemoryBudget:
        return budget_for(fraction, stages, host_total=self.host_total, host_available=self.host_available,
                          backend=self.backend, device_total=self.device_total, device_free=self.device_free,
                          cap=self.cap)

    def usable_bytes(self) -> int:
        """The memory its budgets come from (before ``--memory-fraction``)."""
        return self.budget(1.0, 1).total_bytes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> NodeMemory:
        return cls(**{k: raw[k] for k in cls.__dataclass_fields__ if k in raw})


def kv_bytes_per_token(local_layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Keys and values of one token across ``local_layers`` layers."""
    return local_layers * 2 * kv_heads * head_dim * dtype_bytes


@dataclass(frozen=True)
class TensorBytes:
    """Size of some weights: ``packed`` bytes whose size does not depend on the compute dtype (quantized
    codes) plus ``elements`` stored in it (dense weights, norms, biases, quantization scales)."""

    packed: int = 0
    elements: int = 0

    def nbytes(self, element_bytes: int) -> int:
        return self.packed + self.elements * element_bytes

    def __add__(self, other: TensorBytes) -> TensorBytes:
        return TensorBytes(self.packed + other.packed, self.elements + other.elements)


@dataclass(frozen=True)
class ModelFacts:
    """A model's size as the planner needs it; every decoder layer counts as ``layer``."""

    num_layers: int
    layer: TensorBytes  # one decoder layer
    embedding: TensorBytes  # on the first stage (and on the last when the head is tied)
    head: TensorBytes  # the final norm plus the output projection (the embedding again when tied)
    kv_elements_per_token: int  # keys + values of one token in one layer (2 x kv_heads x head_dim)
    tied_embeddings: bool = False
    # Each decoder layer's own size where they differ (dense first layers beside experts, linear-attention
    # layers beside attention ones); empty when every layer is ``layer``. The planner sizes every layer as
    # ``layer`` (the largest), so a plan never undercounts; ``slice_weight_bytes`` is a given slice's exact size.
    layer_sizes: tuple[TensorBytes, ...] = ()

    def stage_weight_bytes(self, layers: int, *, first: bool, last: bool, element_bytes: int) -> int:
        """Weights of a stage holding ``layers`` layers (plus the embedding when first, the head when last)."""
        total = self.layer.nbytes(element_bytes) * layers
        if first:
            total += self.embedding.nbytes(element_bytes)
        if last:
            # A tied head is the embedding itself: a single stage holds it once.
            total += self.head.nbytes(element_bytes) - (
                self.embedding.nbytes(element_bytes) if first and self.tied_embeddings else 0)
        return total

    def slice_weight_bytes(self, start: int, end: int, *, first: bool, last: bool, element_bytes: int) -> int:
        """Weights of the stage holding layers ``[start, end)``, each at its own size."""
        if not self.layer_sizes:
            return self.stage_weight_bytes(end - start, first=first, last=last, element_bytes=element_bytes)
        ends = self.stage_weight_bytes(0, first=first, last=last, element_bytes=element_bytes)
        return ends + sum(t.nbytes(element_bytes) for t in self.layer_sizes[start:end])

    def kv_bytes_per_token(self, layers: int, element_bytes: int) -> int:
        return layers * self.kv_elements_per_token * element_bytes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
