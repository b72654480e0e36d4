"""Memory facts and rules that the layer planner (coordinator) and every stage (stage_worker) share.

One home for the rules both sides must apply identically, or a plan the coordinator thinks fits would be
refused by the stage that loads it:

- ``NodeMemory``: what a node says about itself (backend, device, memory, cap, speed), read where it runs.
- ``budget_for`` / ``MemoryBudget``: a stage's budget, the memory it computes in times ``--memory-fraction``,
  split evenly between the stages sharing it; ``RUNTIME_OVERHEAD_BYTES`` is what it needs beyond weights and KV.
- ``ModelFacts`` and ``DraftFacts``: a model's and a draft model's size as the planner needs it, kept so
  each stage's compute dtype gives its bytes (``TensorBytes``).
- ``StageKV`` / ``kv_capacity_tokens``: a slice's KV and the token positions of it a room of memory holds.
- ``AUTO_DTYPES`` / ``dtype_bytes``: the compute dtype ``--dtype auto`` picks per backend.

Pure standard library: the core must not load MLX, NumPy or Ray.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from stagemesh_core.errors import UserError
from stagemesh_core.kv_cache_dtype import KVCacheDtype

# What a stage process needs beyond weights and KV: Python, MLX, mlx-lm (which imports
# transformers), gRPC, ring buffers, activations of one batch (docs/performance.md has the figures).
RUNTIME_OVERHEAD_BYTES = 256 * 1024 * 1024

# --dtype auto: the compute dtype each backend runs best (stage_worker.model.stage_model resolves names to MLX dtypes).
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
    """What one node says about its memory and backend, read on that node: the StageHost asks
    ``python -m stage_worker.service.node_probe`` on its own node for MLX's backend, the device, the host's and the
    GPU's memory, the ``STAGEMESH_NODE_MEMORY`` cap and the ``STAGEMESH_NODE_SPEED`` hint."""

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
class LayerKV:
    """What one decoder layer keeps per sequence: ``per_token`` elements of keys and values per position
    (MLA: its latent and rotary key) for at most ``window`` positions (a sliding window; None: every position),
    plus a fixed ``state`` per sequence whatever its length (linear attention's or an SSM's recurrent state)."""

    per_token: int = 0
    window: int | None = None
    state: TensorBytes = TensorBytes()
    # Bytes per position whatever the compute dtype: quantized keys and values' codes (``--kv-cache-dtype``),
    # whose scales and biases are then the ``per_token`` elements.
    packed_per_token: int = 0

    def quantized(self, kv_dtype: KVCacheDtype) -> LayerKV:
        """This layer's KV as ``kv_dtype`` stores it: a plain KV layer's keys and values quantized (its
        positions as codes, scales and biases), a sliding window or a recurrent state as it is (pure)."""
        if not kv_dtype.quantized or self.window is not None or not self.per_token or self.packed_per_token:
            return self
        packed, elements = kv_dtype.quantized_bytes(self.per_token)
        return replace(self, per_token=elements, packed_per_token=packed)


@dataclass(frozen=True)
class StageKV:
    """The KV a slice of layers keeps: ``per_token`` elements per position across its full-context layers,
    ``windows`` ((elements per position, window) of its sliding-window layers, by window size, smallest
    first) and ``state`` per sequence.

    A stage's KV capacity is counted in token positions (the scheduler reserves prompt + max_tokens per
    sequence). Capacity C must hold any set of at most ``max_sequences`` sequences totalling C positions:
    full layers hold C positions, a window layer at most min(C, max_sequences x window) (each sequence keeps
    at most its window), and every sequence its state. ``reserved_bytes`` is that bound, ``capacity`` the
    largest C whose bound fits some room."""

    per_token: int = 0
    windows: tuple[tuple[int, int], ...] = ()
    state: TensorBytes = TensorBytes()
    packed_per_token: int = 0  # bytes per position whatever the dtype (quantized KV's codes: ``LayerKV``)

    @classmethod
    def of_layers(cls, layers: Sequence[LayerKV]) -> StageKV:
        state = TensorBytes()
        by_window: dict[int, int] = {}
        for layer in layers:
            state += layer.state
            if layer.window is not None and layer.per_token:
                by_window[layer.window] = by_window.get(layer.window, 0) + layer.per_token
        return cls(per_token=sum(layer.per_token for layer in layers if layer.window is None),
                   packed_per_token=sum(layer.packed_per_token for layer in layers if layer.window is None),
                   windows=tuple((elements, window) for window, elements in sorted(by_window.items())),
                   state=state)

    def share(self, heads: int, of: int) -> StageKV:
        """What a tensor-parallel member holding ``heads`` of every layer's ``of`` KV heads keeps (pure): its
        part of the keys and values, rounded up; recurrent state counted whole (an upper bound)."""
        def part(elements: int) -> int:
            return -(-elements * heads // of)

        return StageKV(per_token=part(self.per_token), windows=tuple((part(e), w) for e, w in self.windows),
                       state=self.state, packed_per_token=part(self.packed_per_token))

    def per_token_bytes(self, element_bytes: int) -> int:
        """Bytes of one more position in the full-context layers (the part that grows without bound)."""
        return self.per_token * element_bytes + self.packed_per_token

    def sequence_bytes(self, tokens: int, element_bytes: int) -> int:
        """What one sequence of ``tokens`` positions holds in these layers."""
        held = self.per_token * tokens + sum(e * min(tokens, w) for e, w in self.windows)
        return held * element_bytes + self.packed_per_token * tokens + self.state.nbytes(element_bytes)

    def reserved_bytes(self, tokens: int, element_bytes: int, max_sequences: int) -> int:
        """The most that ``tokens`` positions held by up to ``max_sequences`` sequences can take."""
        held = self.per_token * tokens + sum(e * min(tokens, max_sequences * w) for e, w in self.windows)
        return (held * element_bytes + self.packed_per_token * tokens
                + max_sequences * self.state.nbytes(element_bytes))

    def capacity(self, room: int, element_bytes: int, max_sequences: int) -> int | None:
        """The most positions whose ``reserved_bytes`` fit ``room`` (0 when not even the states fit); None when
        any number fits (no full-context layer, and every window and state of ``max_sequences`` fits)."""
        room -= max_sequences * self.state.nbytes(element_bytes)
        if room < 0:
            return 0
        # reserved_bytes grows piecewise linearly: each window layer stops growing at max_sequences x window.
        slope = self.per_token_bytes(element_bytes) + sum(e for e, _ in self.windows) * element_bytes
        used = position = 0
        for limit, elements in sorted((max_sequences * w, e) for e, w in self.windows):
            if used + slope * (limit - position) > room:
                break
            used, position = used + slope * (limit - position), limit
            slope -= elements * element_bytes
        else:
            if slope == 0:
                return None
        return position + (room - used) // slope


def kv_capacity_tokens(room: int, kv: StageKV, element_bytes: int, max_sequences: int, max_model_len: int) -> int:
    """Token positions of KV a stage holds in ``room`` bytes (its budget less weights and runtime): ``capacity``,
    or every sequence at full length when any number fits. The planner and the stage both count by this."""
    tokens = kv.capacity(room, element_bytes, max_sequences)
    return max_sequences * max_model_len if tokens is None else max(0, tokens)


def weights_share(weights: TensorBytes, workers: int) -> TensorBytes:
    """A worker's part of ``weights`` cut ``workers`` ways, rounded up (pure)."""
    return TensorBytes(-(-weights.packed // workers), -(-weights.elements // workers))


@dataclass(frozen=True)
class ModelFacts:
    """A model's size as the planner needs it: each decoder layer's weights and KV, the embedding, the head."""

    num_layers: int
    layer: TensorBytes  # the largest decoder layer
    embedding: TensorBytes  # on the first stage (and on the last when the head is tied)
    head: TensorBytes  # the final norm plus the output projection (the embedding again when tied)
    kv_elements_per_token: int  # keys + values of one token in the widest layer (2 x kv_heads x head_dim)
    tied_embeddings: bool = False
    # Each decoder layer's own size where they differ (dense first layers beside experts, linear-attention
    # layers beside attention ones); empty when every layer is ``layer``.
    layer_sizes: tuple[TensorBytes, ...] = ()
    # Each decoder layer's KV where layers differ in kind (sliding windows, recurrent state, widths); empty
    # when every layer keeps ``kv_elements_per_token`` per position of the whole context.
    kv_layers: tuple[LayerKV, ...] = ()
    # One latent cached for every head (DeepSeek's MLA): each worker of a -tp group keeps it whole.
    kv_latent: bool = False

    def layer_bytes(self, index: int, element_bytes: int) -> int:
        return (self.layer_sizes[index] if self.layer_sizes else self.layer).nbytes(element_bytes)

    def ends_bytes(self, *, first: bool, last: bool, element_bytes: int) -> int:
        """The embedding when first, the head when last (a lone stage holds a tied matrix once)."""
        total = self.embedding.nbytes(element_bytes) if first else 0
        if last:
            total += self.head.nbytes(element_bytes) - (
                self.embedding.nbytes(element_bytes) if first and self.tied_embeddings else 0)
        return total

    def stage_weight_bytes(self, layers: int, *, first: bool, last: bool, element_bytes: int) -> int:
        """Weights of a stage holding ``layers`` layers each counted as the largest (plus its ends)."""
        return self.layer.nbytes(element_bytes) * layers + self.ends_bytes(first=first, last=last,
                                                                           element_bytes=element_bytes)

    def slice_weight_bytes(self, start: int, end: int, *, first: bool, last: bool, element_bytes: int) -> int:
        """Weights of the stage holding layers ``[start, end)``, each at its own size: what it loads."""
        ends = self.ends_bytes(first=first, last=last, element_bytes=element_bytes)
        return ends + sum(self.layer_bytes(i, element_bytes) for i in range(start, end))

    def layer_kv(self, index: int) -> LayerKV:
        return self.kv_layers[index] if self.kv_layers else LayerKV(self.kv_elements_per_token)

    def slice_kv(self, start: int, end: int) -> StageKV:
        """The KV the stage holding layers ``[start, end)`` keeps (see ``StageKV``)."""
        return StageKV.of_layers([self.layer_kv(i) for i in range(start, end)])

    def worker_share(self, tensor_parallel_size: int) -> ModelFacts:
        """What a worker of a ``tensor_parallel_size``-way group holds as the planner counts it (pure): each
        layer's weights and KV divided by the group, rounded up (a latent KV, ``kv_latent``, whole, as every
        worker keeps it); the embedding and head whole (worker 0 keeps them). An uneven split (KV heads that do
        not divide) gives the first workers a head more, which each worker's own budget check at load counts
        exactly. The same model at -tp 1."""
        t = tensor_parallel_size
        if t == 1:
            return self
        if self.kv_latent:
            return replace(self, layer=weights_share(self.layer, t),
                           layer_sizes=tuple(weights_share(b, t) for b in self.layer_sizes))

        def kv(layer: LayerKV) -> LayerKV:
            return replace(layer, per_token=-(-layer.per_token // t),
                           packed_per_token=-(-layer.packed_per_token // t))

        return replace(self, layer=weights_share(self.layer, t),
                       layer_sizes=tuple(weights_share(b, t) for b in self.layer_sizes),
                       kv_elements_per_token=-(-self.kv_elements_per_token // t),
                       kv_layers=tuple(kv(layer) for layer in self.kv_layers))

    def with_kv_cache_dtype(self, kv_dtype: KVCacheDtype) -> ModelFacts:
        """The same model with its KV stored as ``kv_dtype`` says (``LayerKV.quantized``, pure): what the
        planner and every stage count KV by."""
        if not kv_dtype.quantized:
            return self
        layers = tuple(self.layer_kv(i).quantized(kv_dtype) for i in range(self.num_layers))
        return replace(self, kv_layers=layers)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# The draft's batch (stage_worker.speculation.draft_batch): columns are added in steps of DRAFT_COLUMN_STEP,
# and a batch out of columns compacts its holes away (rejected proposals, padding) only once they exceed
# DRAFT_HOLES_TO_COMPACT of its columns; until then it grows.
DRAFT_COLUMN_STEP = 256
DRAFT_HOLES_TO_COMPACT = 0.25


def draft_kv_columns(max_model_len: int, proposals: int) -> int:
    """The most columns of the draft's KV one speculating sequence may span (pure): its tokens (``max_model_len``
    plus the proposals it feeds), holes up to ``DRAFT_HOLES_TO_COMPACT`` of the columns, one step of growth."""
    tokens = max_model_len + proposals
    return int(tokens / (1 - DRAFT_HOLES_TO_COMPACT)) + 2 * DRAFT_COLUMN_STEP


@dataclass(frozen=True)
class DraftFacts:
    """A draft model on the entry stage: its weights, the KV elements one position of one sequence takes in all
    its layers, and how many sequences may hold draft KV at once (``--speculative-config``'s
    ``disable_by_batch_size``, at most ``--max-num-seqs``: a sequence gets draft KV only while no more run) with
    how many proposals each feeds.

    Its KV spans the columns its batch may (``draft_kv_columns``, holes included); the planner and the stage
    both subtract ``reserved_bytes`` from the entry stage's room."""

    weights: TensorBytes
    kv_elements_per_token: int
    sequences: int
    proposals: int

    def weight_bytes(self, element_bytes: int) -> int:
        return self.weights.nbytes(element_bytes)

    def kv_bytes_per_token(self, element_bytes: int) -> int:
        return self.kv_elements_per_token * element_bytes

    def reserved_bytes(self, element_bytes: int, max_model_len: int) -> int:
        """Its weights plus the most KV its speculating sequences may hold."""
        columns = draft_kv_columns(max_model_len, self.proposals)
        return self.weight_bytes(element_bytes) + self.sequences * columns * self.kv_bytes_per_token(element_bytes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> DraftFacts:
        return cls(TensorBytes(**raw["weights"]), raw["kv_elements_per_token"], raw["sequences"], raw["proposals"])

