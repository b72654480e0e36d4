"""One stage's slice of a model: mlx-lm's own layers, holding only what this stage owns.

``StageModel.load`` builds mlx-lm's model for the architecture (lazily: nothing is allocated until evaluated),
keeps the decoder layers ``[start, end)`` plus the embedding on the first stage and the final norm and head on
the last (the embedding again when the head is tied), quantizes exactly the modules whose weights arrive
quantized, loads those weights strictly, and casts the floating parameters to the compute dtype every stage
of the pipeline agrees on. With ``--load-format dummy`` the same slice gets random weights made in that dtype
(``dummy_weights``); nothing else changes. Forward pieces are separate so a stage runs only its part:
``embed`` (first stage), ``run_packed`` (every stage: many sequences' rows at once), ``logits`` (last stage,
float32 for sampling). Two paths (``mlx_arch``, ``runs_packed``): llama, qwen2 and qwen3 with full attention
run through ``packed_forward``; every other served architecture is a ``StackStageModel``.
``resolve_compute_dtype`` and ``choose_dense_weights`` decide the dtype and whether weights run dense.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.cache import KVCache
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

from stage_worker.cache.quantized_kv import quantized_caches
from stage_worker.checkpoint import load_progress
from stage_worker.checkpoint.checkpoint_check import mismatched_scales
from stage_worker.checkpoint.mlx_arch import PACKED_ARCHITECTURES, ArchFacts, describe
from stage_worker.checkpoint.model_spec import ModelFormatError, ModelSpec, tensor_mismatch
from stage_worker.checkpoint.stage_weights import load_stage_weights
from stage_worker.model.device import current_backend
from stage_worker.model.expert_routing import ExpertsPolicy
from stage_worker.model.expert_routing import install as install_expert_routing
from stage_worker.model.fused_projections import FusedLayer, fuse_layer_projections
from stage_worker.model.layer_stack import stack_layers
from stage_worker.model.packed_forward import DecodeRows, Segment, packed_layers
from stage_worker.model.sibling_projections import join_sibling_projections
from stage_worker.parallel.share_reads import DequantizedSource, Source, Stored, placeholder, read_cut_parts, trace_cut
from stage_worker.parallel.tensor_parallel import (
    LayerShare,
    divided_counts,
    even_share,
    shard_layers,
    shard_model,
    shardable,
    split_layer,
)
from stagemesh_core.errors import UserError
from stagemesh_core.kv_cache_dtype import AUTO
from stagemesh_core.layer_split import LayerRange
from stagemesh_core.memory import AUTO_DTYPES

COMPUTE_DTYPES: dict[str, mx.Dtype] = {
    "float32": mx.float32,
    "float16": mx.float16,
    "bfloat16": mx.bfloat16,
}


# What ``--dtype auto`` computes in, per backend (stage_worker.model.device): the CPU backend has no fast
# half-precision kernels; Metal's are float16; NVIDIA's tensor cores take bfloat16 at the same speed,
# with float32's range (no overflow in activations that float16 would clip). The table is the core's
# (stagemesh_core.memory.AUTO_DTYPES), because the layer planner sizes each stage's weights by it.

def resolve_compute_dtype(name: str, backend: str | None = None) -> mx.Dtype:
    """``--dtype NAME`` as an MLX dtype; ``auto`` follows ``backend`` (``AUTO_DTYPES``; None: this process's).

    Pure given ``backend``; raises ``ValueError`` naming the flag for an unknown dtype."""
    if name == "auto":
        if backend is None:
            backend = current_backend()
        name = AUTO_DTYPES.get(backend, "float32")
    try:
        return COMPUTE_DTYPES[name]
    except KeyError:
        raise ValueError(
            f"--dtype {name!r} is not supported; use auto, {', '.join(COMPUTE_DTYPES)}"
        ) from None


DEQUANTIZE_CHOICES = ("auto", "on", "off")


def choose_dense_weights(
    setting: str, *, backend: str, blas: str, quantized: bool, dense_bytes: int, memory_budget: int
) -> tuple[bool, str]:
    """Whether to run a quantized checkpoint with dense weights, and why (pure).

    ``auto`` weighs speed against memory, per ``backend`` (stage_worker.model.device): on
    Metal the quantized kernels are the fast path; on CUDA MLX compiles its
    quantized kernels per new batch shape on first use, a stall each
    (docs/performance.md, ``--dequantize``, has the figures), and on the CPU only a tuned BLAS gains
    from batching; so on both, dense weights when they fit in half the stage's memory
    budget (and, on the CPU, when an optimized BLAS is loaded).
    """
    if setting not in DEQUANTIZE_CHOICES:
        raise ValueError(f"--dequantize {setting!r}: choose auto, on or off")
    if not quantized:
        return False, "the checkpoint is not quantized"
    if setting != "auto":
        return setting == "on", f"--dequantize {setting}"
    if backend == "metal":
        return False, "auto: Metal runs quantized kernels fastest"
    if backend == "cuda":
        if dense_bytes > memory_budget // 2:
            return False, (f"auto: dense weights ({dense_bytes / 1e6:.0f} MB) would exceed half this stage's "
                           f"GPU memory budget ({memory_budget / 1e6:.0f} MB); quantized weights")
        return True, (f"auto: CUDA's quantized kernels stall on each new batch shape; dense weights "
                      f"{dense_bytes / 1e6:.0f} MB fit the memory budget")
    if blas not in ("openblas", "mkl"):
        return False, (f"auto: the {blas} BLAS gains nothing from dense weights; install libopenblas0-pthread "
                       f"for the fast path")
    if dense_bytes > memory_budget // 2:
        return False, (f"auto: dense weights ({dense_bytes / 1e6:.0f} MB) would exceed half this stage's memory "
                       f"budget ({memory_budget / 1e6:.0f} MB)")
    return True, f"auto: {blas} BLAS, dense weights {dense_bytes / 1e6:.0f} MB fit the memory budget"


def model_fingerprint(spec: ModelSpec) -> str:
    """Identifies the architecture and shapes, so neighbours can check they load the same model."""
    text = json.dumps({"type": spec.model_type, "args": dict(spec.args)}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class _Slice(nn.Module):
    """Container whose parameter names are the stage-local weight names."""

    def __init__(self, embed_tokens, layers, norm, lm_head) -> None:
        super().__init__()
        if embed_tokens is not None:
            self.embed_tokens = embed_tokens
        self.layers = layers
        if norm is not None:
            self.norm = norm
        if lm_head is not None:
            self.lm_head = lm_head


@dataclass(frozen=True)
class StageRole:
    layers: LayerRange
    is_first: bool
    is_last: bool


class StageModel:
    """The model slice of one stage, ready to compute.

    This class is the packed path (llama, qwen2 and qwen3 with full attention only): ``packed_forward`` runs
    mlx-lm's layers with their calls reordered so every sequence's rows share each matmul. A GPU stage then
    joins each layer's q/k/v and gate/up projections (``fuse_projections``), after which its layers run only
    through ``run_packed``."""

    _LAYERS_PREFIX = "layers."  # where the slice's decoder layers sit among its parameter names

    def __init__(self, spec: ModelSpec, role: StageRole, dtype: mx.Dtype, module: nn.Module) -> None:
        self.spec = spec
        self.role = role
        self.dtype = dtype
        self._module = module
        self.hidden_size = spec.hidden_size
        # Multi-row chunks attend over whole cache buffers where attention kernels are planned per shape
        # (``packed_forward.packed_layers``): MLX's CUDA backend.
        self.pad_keys = current_backend() == "cuda"
        # A one-token decode group's masked attention as one kernel (``masked_decode_kernel``, CUDA only); the
        # stage turns it on (``STAGEMESH_DECODE_KERNEL``).
        self.fused_decode = False
        # How keys and values are stored (``--kv-cache-dtype``); the stage sets it before any sequence starts.
        self.kv_cache_dtype = AUTO
        # Where each parameter loaded lazily from safetensors lies in the files, by its name in the module:
        # what ``shard`` reads its part of alone. Empty for a whole load (already read) and other formats.
        self.sources: dict[str, Source] = {}
        self.parts_read_bytes = 0  # what ``shard`` so read: the cut tensors' parts, in the bytes they are held
        self._measure()

    def _measure(self) -> None:
        module = self._module
        self.quantized = any(_is_quantized(m) for _, m in module.named_modules())
        params = _flat_parameters(module)
        self.weight_bytes = sum(v.nbytes for _, v in params)
        self.layer_bytes = sum(v.nbytes for name, v in params if name.startswith(self._LAYERS_PREFIX))

    def dense_bytes(self) -> int:
        """Bytes the weights would take dequantized to the compute dtype."""
        total = 0
        for _, m in self._module.named_modules():
            if _is_quantized(m):
                # 3, 5 and 6-bit codes straddle uint32 words: count the weights by bits, not per word.
                total += m.weight.size * 32 // m.bits * self.dtype.size
                if "bias" in m:
                    total += m.bias.nbytes
            elif not list(m.children()):
                total += sum(v.nbytes for _, v in _flat_parameters(m))
        return total

    def dequantize(self, evaluate: bool = True) -> None:
        """Replace quantized layers by dense ones in the compute dtype: on the CPU and on CUDA this is
        the fast path, because dense GEMMs gain from batching while MLX's quantized matmul there
        does not (see ``choose_dense_weights``). Without ``evaluate`` the dense weights stay lazy, for
        ``shard`` to cut before they exist (a lazily loaded member's)."""
        if not self.quantized:
            return
        for name, child in _dequantize_modules(self._module):
            self._record_dequantized(name, child)
        self._module.set_dtype(self.dtype, lambda d: mx.issubdtype(d, mx.floating))
        if evaluate:
            mx.eval(self._module.parameters())
        self._measure()

    def _record_dequantized(self, name: str, child: nn.Module) -> None:
        """The dense weight made of module ``name``'s stored triple, where all of it lies in the files."""
        parts = [self.sources.pop(f"{name}.{p}", None) for p in ("weight", "scales", "biases")]
        weight, scales, biases = parts
        if weight is None or scales is None or (biases is None) != (getattr(child, "biases", None) is None):
            if any(p is not None and placeholder(p) for p in parts):  # else served as zeros
                raise ModelFormatError(f"{self.spec.path}: {name}'s quantized parts lie in different places")
            return
        assert not isinstance(weight, DequantizedSource) and not isinstance(scales, DequantizedSource)
        assert not isinstance(biases, DequantizedSource)
        self.sources[f"{name}.weight"] = DequantizedSource(weight, scales, biases, child.scales.dtype,
                                                           child.group_size, child.bits, child.mode)

    def _cut(self, cut: Callable[[nn.Module], Any]) -> None:
        """Run this member's ``cut`` on the module, then evaluate it layer by layer. Loaded lazily from files,
        each cut tensor's part is read alone (``share_reads``): the cut traced on probes, then run, then each
        traced parameter replaced by its part read from the files, and (a GGUF's placeholders) each parameter
        the cut left whole by all of it, layer after layer. A GGUF member refuses a cut it cannot trace."""
        before = self._layer_sizes()
        kept = trace_cut(self._module, cut) if self.sources else {}
        held_before = _flat_parameters(self._module)  # kept alive: an id is unique only while its array lives
        loaded = {id(a): name for name, a in held_before}
        cut(self._module)
        after = _flat_parameters(self._module)
        left_whole = {name: loaded[id(a)] for name, a in after if id(a) in loaded}
        del held_before
        untraced = [name for name, _ in after if name not in left_whole and name not in kept]
        if untraced and any(placeholder(s) for s in self.sources.values()):
            raise ModelFormatError(
                f"-tp: {self.spec.path}'s cut of {untraced[0]} is not a selection of its stored tensor, and a GGUF's "
                "member reads only what it keeps: serve this model with -pp instead, or from safetensors")
        layers = self._LAYERS_PREFIX
        read: list[int] = []

        def read_parts(module: nn.Module, prefix: str) -> None:
            """Read what lies under ``prefix`` (a layer's), or with ``prefix`` empty what lies outside the layers."""
            def under(name: str) -> bool:
                return name.startswith(prefix) if prefix else not name.startswith(layers)

            read.append(read_cut_parts(module, {n[len(prefix):]: k for n, k in kept.items() if under(n)},
                                       self.sources, {n[len(prefix):]: b for n, b in left_whole.items() if under(n)}))

        self._evaluate_by_layer(before, read_parts)
        self.sources = {}
        self.parts_read_bytes = sum(read)
        self._measure()

    def fuse_projections(self) -> FusedLayer:
        """Join each layer's q/k/v and gate/up projections (``fused_projections``); what was joined in every
        layer. A stage calls it after choosing dense or quantized weights and before its warm-up, so the
        kernels warmed are the ones it will run."""
        fused = [fuse_layer_projections(layer) for layer in self._module.layers]
        self._measure()
        return FusedLayer(qkv=all(f.qkv for f in fused), gate_up=all(f.gate_up for f in fused))

    def shard(self, group: Any, rank_0_extra: int = 0) -> LayerShare:
        """Keep only this member's share of every layer in ``group``, a tensor-parallel group of MLX's
        (``tensor_parallel``); called after choosing dense or quantized weights and before
        ``fuse_projections``, so the joined projections are joined from the member's own rows.
        ``rank_0_extra``: weight elements worker 0 reads per token beyond the layers (the head of the last
        stage), which the MLP's split balances; the same on every member."""
        shares: list[LayerShare] = []
        self._cut(lambda module: shares.append(shard_layers(list(module.layers), group, rank_0_extra)))
        return shares[-1]

    def _layer_sizes(self) -> list[int]:
        """Each layer's bytes as loaded (lazy or not), and last the rest of the slice (ends, norms)."""
        sizes = [sum(v.nbytes for _, v in _flat_parameters(layer)) for layer in self.layers]
        return [*sizes, max(0, self.weight_bytes - sum(sizes))]

    def _evaluate_by_layer(self, sizes: list[int], read_parts: Callable[[nn.Module, str], Any]) -> None:
        """Evaluate the cut weights: first the ends (embedding, norm, head), then one layer after the other. A
        lazily loaded member (``load`` with ``evaluate=False``) thereby reads, or makes, each layer's whole
        tensors only while cutting that layer, and holds about its share of the stage at any time. The ends
        go first because a dense embedding is made from its quantized form through a half-precision copy,
        three of it at once for a moment: with nothing else held yet, that moment is not the load's peak.
        The bytes the readers expected but left unread (``load_progress.outstanding``) are counted down in
        proportion to the sizes (each layer's, the ends' last). ``read_parts(module, prefix)`` first replaces
        what is to be read from the files of the module's parameters named under ``prefix`` (``""``: the
        ends)."""
        pending, whole = load_progress.outstanding(), max(1, sum(sizes))
        read_parts(self._module, "")
        in_layers = {id(v) for layer in self.layers for _, v in _flat_parameters(layer)}
        mx.eval([v for _, v in _flat_parameters(self._module) if id(v) not in in_layers])
        counted = pending * sizes[-1] // whole
        load_progress.read(counted)
        for index, (layer, size) in enumerate(zip(self.layers, sizes)):
            read_parts(layer, f"{self._LAYERS_PREFIX}{index}.")
            mx.eval(layer.parameters())
            part = pending * size // whole
            load_progress.read(part)
            counted += part
        load_progress.read(pending - counted)

    def route_experts(self, policy: ExpertsPolicy) -> int:
        """Run this slice's unquantized expert blocks by ``policy`` (``expert_routing``); how many follow it.
        Called after choosing dense or quantized weights, before the warm-up, as ``fuse_projections`` is."""
        return install_expert_routing(self._module, policy)

    @classmethod
    def load(cls, spec: ModelSpec, role: StageRole, dtype: mx.Dtype, evaluate: bool = True) -> StageModel:
        """The slice ``role`` of ``spec`` in ``dtype``, by the path its architecture takes (module docstring):
        this class or ``StackStageModel``. ``evaluate=False`` (a tensor-parallel member) leaves the weights
        lazy, unread, until ``shard`` has cut them (``load_stage_weights``)."""
        if not runs_packed(spec):
            return StackStageModel.load_stack(spec, role, dtype, evaluate)
        arch = importlib.import_module(f"mlx_lm.models.{spec.model_type}")
        args = arch.ModelArgs.from_dict(dict(spec.args))
        full = arch.Model(args)  # lazy: unowned parts are never evaluated
        needs_embedding = role.is_first or (role.is_last and spec.tie_word_embeddings)
        lm_head = None
        if role.is_last and not spec.tie_word_embeddings:
            lm_head = full.lm_head
        module = _Slice(
            embed_tokens=full.model.embed_tokens if needs_embedding else None,
            layers=full.model.layers[role.layers.start : role.layers.end],
            norm=full.model.norm if role.is_last else None,
            lm_head=lm_head,
        )
        del full
        sources = _load_slice_weights(module, spec, role, dtype, local_name=_local_name, global_path=_global_path,
                                      evaluate=evaluate)
        model = cls(spec, role, dtype, module)
        model.sources = sources
        return model

    @property
    def layers(self) -> list[nn.Module]:
        """This stage's decoder layers (mlx-lm modules)."""
        return self._module.layers

    def new_caches(self) -> list[Any]:
        return quantized_caches([KVCache() for _ in self._module.layers], self.kv_cache_dtype)

    def embed(self, token_ids: mx.array) -> mx.array:
        """``int32[T]`` -> ``[T, hidden]`` in the compute dtype."""
        return self._module.embed_tokens(token_ids).astype(self.dtype)

    def run_layers(self, hidden: mx.array, caches: list[KVCache]) -> mx.array:
        """``[n, hidden]`` rows of one sequence through this stage's layers (lazy)."""
        return self.run_packed(hidden, [Segment(caches, hidden.shape[0])])

    def run_packed(
        self, hidden: mx.array, segments: Sequence[Segment], decode: DecodeRows | None = None
    ) -> mx.array:
        """``[T, hidden]`` rows of several sequences (prompt chunks and a decode group), lazy."""
        return packed_layers(self._module.layers, hidden, segments, decode, pad_keys=self.pad_keys,
                             fused_decode=self.fused_decode)

    def logits(self, hidden: mx.array) -> mx.array:
        """Final norm and head on ``[k, hidden]`` rows; float32 ``[k, vocab]`` (lazy)."""
        h = self._module.norm(hidden)
        if "lm_head" in self._module:
            out = self._module.lm_head(h)
        else:
            out = self._module.embed_tokens.as_linear(h)
        return out.astype(mx.float32)


def runs_packed(spec: ModelSpec) -> bool:
    """Whether ``spec``'s stages take ``packed_forward``: llama, qwen2 and qwen3 with full attention only."""
    if spec.model_type not in PACKED_ARCHITECTURES:
        return False
    return all(t == "full_attention" for t in spec.args.get("layer_types") or [])


def check_shardable(spec: ModelSpec, size: int) -> None:
    """Refuse, before any worker loads, a ``-tp size`` this model's stages cannot be cut into: the packed path
    cuts by whole KV-head groups (uneven counts allowed, at least one KV head and one intermediate feature a
    worker: ``split_layer``), every other architecture evenly, by mlx-lm's own ``Model.shard`` or
    ``tensor_parallel.SHARDERS``' cut, one of which it must have and whose counts must divide (``even_share`` of
    ``divided_counts``). Raises ``UserError`` naming what would work."""
    if size == 1:
        return
    args = spec.args
    if runs_packed(spec):
        heads = int(args["num_attention_heads"])
        split_layer(heads, int(args.get("num_key_value_heads") or heads), int(args["intermediate_size"]), size, 0)
        return
    if not shardable(spec.model_type):
        raise UserError(f"-tp {size}: no tensor-parallel sharding for {spec.model_type} (mlx-lm has none, nor "
                        "stagemesh); serve it with -pp (pipeline stages) instead")
    even_share(args, size, 0, divided_counts(spec.model_type, args))


class StackStageModel(StageModel):
    """A slice of any served mlx-lm architecture: its layers through ``layer_stack``, its ends through mlx-lm's
    own ``__call__`` code. ``_module`` is mlx-lm's ``Model`` itself, built lazily and cut to the slice:
    ``model.layers`` holds this stage's layers only, and the ends it does not compute are removed.

    The layers run with the caches the model's ``make_cache`` asks for. The embedding is the inner model's
    ``__call__`` up to its first layer (scaling included), the head the outer model's ``__call__`` after its
    norm (tied or not). A GPU stage joins its layers' sibling projections where mlx-lm's code still calls them
    as parts (``sibling_projections``)."""

    _LAYERS_PREFIX = "model.layers."

    def __init__(self, spec: ModelSpec, role: StageRole, dtype: mx.Dtype, module: nn.Module,
                 caches: Sequence[Any], facts: ArchFacts) -> None:
        super().__init__(spec, role, dtype, module)
        self._prototype_caches = list(caches)
        self._facts = facts
        self._bind_ends()

    @classmethod
    def load_stack(cls, spec: ModelSpec, role: StageRole, dtype: mx.Dtype, evaluate: bool = True) -> StackStageModel:
        arch = importlib.import_module(f"mlx_lm.models.{spec.model_type}")
        full = arch.Model(arch.ModelArgs.from_dict(dict(spec.args)))  # lazy: unowned parts are never evaluated
        facts = describe(spec.model_type, spec.args)
        start, end = role.layers.start, role.layers.end
        # The model's own choice of cache per layer (windows, recurrent state), before the slice renumbers them.
        caches = (full.make_cache() if hasattr(full, "make_cache") else [KVCache() for _ in full.model.layers])
        inner = full.model
        inner.layers = inner.layers[start:end]
        if not (role.is_first or (role.is_last and spec.tie_word_embeddings)):
            inner.pop("embed_tokens")
        if not role.is_last:
            inner.pop("norm")
        for name in {n.split(".", 1)[0] for n in facts.head_names}:
            if not role.is_last or spec.tie_word_embeddings:
                full.pop(name)
        if spec.tie_word_embeddings and facts.head_names:
            # A model whose head is tied by its files (Gemma 3's sanitize decides so): the head is the embedding.
            full.tie_word_embeddings = True

        def local_name(name: str, layers: LayerRange) -> str:
            if name.startswith("model.layers."):
                index, rest = name[len("model.layers."):].split(".", 1)
                return f"model.layers.{int(index) - layers.start}.{rest}"
            return name

        def global_path(path: str, layers: LayerRange) -> str:
            if path.startswith("model.layers."):
                index, rest = path[len("model.layers."):].split(".", 1)
                return f"model.layers.{int(index) + layers.start}.{rest}"
            return path

        sources = _load_slice_weights(full, spec, role, dtype, local_name=local_name, global_path=global_path,
                                      evaluate=evaluate)
        model = cls(spec, role, dtype, full, caches[start:end], facts)
        model.sources = sources
        return model

    def _bind_ends(self) -> None:
        """The views that compute the ends with mlx-lm's own code; remade whenever modules are replaced."""
        full = self._module
        self._embed_view = None
        if self.role.is_first:
            view = copy.copy(full.model)
            view.layers = [_FirstLayerInput(full.model.layers[0])]
            self._embed_view = view
        self._head_view = None
        if self.role.is_last:
            head = copy.copy(full)
            head.model = _NormOnly(full.model)
            self._head_view = head

    def dequantize(self, evaluate: bool = True) -> None:
        super().dequantize(evaluate)
        self._bind_ends()

    def shard(self, group: Any, rank_0_extra: int = 0) -> LayerShare:
        """This member's share of every layer, cut evenly by mlx-lm's own ``Model.shard`` or, where mlx-lm has
        none, ``tensor_parallel.SHARDERS``' cut (``even_share`` refuses counts they cannot split); the ends are rebound
        to the cut modules. ``rank_0_extra`` is the packed path's (an even cut has nothing to balance)."""
        share = even_share(self.spec.args, group.size(), group.rank(),
                           divided_counts(self.spec.model_type, self.spec.args))
        self._cut(lambda module: shard_model(module, self.spec.model_type, group))
        self._bind_ends()
        return share

    def fuse_projections(self) -> FusedLayer:
        """Join each layer's sibling projections (q/k/v, gate/up, experts' gate/up) where mlx-lm's own code
        still calls them as before (``sibling_projections``); what was joined in every layer."""
        joined = [join_sibling_projections(layer) for layer in self.layers]
        self._measure()
        return FusedLayer(qkv=all(j.qkv for j in joined), gate_up=all(j.gate_up for j in joined))

    @property
    def layers(self) -> list[nn.Module]:
        return self._module.model.layers

    def new_caches(self) -> list[Any]:
        """Fresh caches of the kinds the model asks for, one per layer of the slice (its plain KV layers
        quantized as ``kv_cache_dtype`` says)."""
        return quantized_caches(copy.deepcopy(self._prototype_caches), self.kv_cache_dtype)

    @property
    def exact_prefix_reuse(self) -> bool:
        return self._facts.exact_prefix_reuse

    def embed(self, token_ids: mx.array) -> mx.array:
        """``int32[T]`` -> ``[T, hidden]``: what the model's first layer receives (embedding scale included)."""
        assert self._embed_view is not None, "only the first stage embeds"
        try:
            # A cache entry per layer of the whole model: the model indexes its caches by global position.
            self._embed_view(token_ids[None], cache=[None] * self.spec.num_layers)
        except _LayerInput as reached:
            return reached.hidden[0].astype(self.dtype)
        raise ModelFormatError(f"mlx-lm's {self.spec.model_type} model never called its first layer")

    def run_packed(self, hidden: mx.array, segments: Sequence[Segment], decode: DecodeRows | None = None) -> mx.array:
        return stack_layers(self._module.model.layers, hidden, segments, decode, self._facts.array_masks)

    def logits(self, hidden: mx.array) -> mx.array:
        """Final norm and the model's own head on ``[k, hidden]``; float32 ``[k, vocab]`` (lazy)."""
        if self._head_view is None:
            raise AttributeError("only the last stage computes logits")
        return self._head_view(hidden[None])[0].astype(mx.float32)


class _LayerInput(Exception):
    """Carries what the first layer was called with, out of the model's ``__call__``."""

    def __init__(self, hidden: mx.array) -> None:
        super().__init__("first layer reached")
        self.hidden = hidden


class _FirstLayerInput(nn.Module):
    """Stands in for the layers when embedding: stops the model's forward at its first layer's input. The
    model may read the layer's attributes first (Qwen3-Next asks whether it is linear): the real layer answers."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def __getattr__(self, key: str) -> Any:
        try:
            return super().__getattr__(key)
        except AttributeError:
            if key == "layer" or "layer" not in self:
                raise
            return getattr(self["layer"], key)

    def __call__(self, h: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        raise _LayerInput(h)


class _NormOnly(nn.Module):
    """Stands in for the inner model when computing the head: the hidden states in, the final norm out."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.norm = inner.norm
        if "embed_tokens" in inner:
            self.embed_tokens = inner.embed_tokens  # a tied head multiplies by it

    def __call__(self, hidden: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        return self.norm(hidden)


def _load_slice_weights(module: nn.Module, spec: ModelSpec, role: StageRole, dtype: mx.Dtype, *,
                        local_name, global_path, evaluate: bool = True) -> dict[str, Source]:
    """Load the slice's weights into ``module`` (named by ``local_name``), quantizing exactly the modules that
    arrive quantized, strictly, then cast to ``dtype`` and (with ``evaluate``) evaluate. Without ``evaluate``:
    where each parameter that is a stored tensor (cast at most) lies in the files, by its name in ``module``."""
    stored: dict[str, Stored] = {}
    weights = load_stage_weights(
        spec, role.layers.as_range(), with_embedding=role.is_first, with_head=role.is_last, dtype=dtype,
        evaluate=evaluate, sources=None if evaluate else stored,
    )
    local = {local_name(k, role.layers): v for k, v in weights.items()}
    sources: dict[str, Source] = {local_name(k, role.layers): v for k, v in stored.items()}
    del weights

    def quantize_predicate(path: str, _module: nn.Module):
        if f"{path}.scales" not in local:
            return False
        params = spec.quantization_for(global_path(path, role.layers))
        if params is None:
            raise ModelFormatError(f"{path} arrives quantized but the model config gives no bits")
        return params.as_kwargs()

    nn.quantize(module, class_predicate=quantize_predicate)
    _check_tensors(spec, role, dict(_flat_parameters(module)), local, lambda name: global_path(name, role.layers))
    module.load_weights(list(local.items()), strict=True)
    # Only a parameter that is the loaded array itself is the stored tensor (set_dtype below only casts it).
    held = dict(_flat_parameters(module))
    unread = [name for name, source in sources.items() if held.get(name) is not local[name] and placeholder(source)]
    if unread:  # a placeholder the member could not trace to its blocks would be served as zeros
        raise ModelFormatError(f"{spec.path}: {unread[0]} is not held as loaded, so a tensor-parallel member cannot "
                               "read it")
    sources = {name: source for name, source in sources.items() if held.get(name) is local[name]}
    module.set_dtype(dtype, lambda d: mx.issubdtype(d, mx.floating))
    module.eval()
    if evaluate:
        mx.eval(module.parameters())
    return sources


def _check_tensors(spec: ModelSpec, role: StageRole, expected: dict[str, mx.array], given: dict[str, mx.array],
                   global_name) -> None:
    """``ModelFormatError`` naming every tensor (by its name in the checkpoint's numbering) that the slice lacks,
    holds in another shape than mlx-lm's model for this config, or holds beyond it."""
    missing = [global_name(n) for n in expected if n not in given]
    shapes = [f"{global_name(n)} is {tuple(given[n].shape)} in the files, {tuple(a.shape)} by the config"
              for n, a in expected.items() if n in given and given[n].shape != a.shape]
    # The scales' kind first: a mislabelled mode shows there, where its shapes may agree.
    shapes = mismatched_scales(expected, given, global_name) + shapes
    problems = tensor_mismatch(missing, shapes, [global_name(n) for n in given if n not in expected])
    if problems:
        raise ModelFormatError(f"{spec.path}: the weights of layers {role.layers} do not match mlx-lm's "
                               f"{spec.model_type} model for its config.json: {problems}")


def _dequantize_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """Swap every quantized linear, embedding and expert block under ``module`` for its dense twin, in place;
    the ``(name, quantized module)`` of each one swapped.

    What ``mlx_lm.utils.dequantize_model`` does (``tests/test_mlx_quantization.py`` holds the two equal); it is
    not called because importing ``mlx_lm.utils`` imports transformers, which a stage process otherwise never
    loads (``stage_worker.model.lean_mlx_lm``)."""
    dense: list[tuple[str, nn.Module]] = []
    replaced: list[tuple[str, nn.Module]] = []  # (name, the quantized module) of each one swapped
    for name, child in module.named_modules():
        twin: nn.Module
        if isinstance(child, nn.QuantizedLinear):
            twin = nn.Linear(1, 1, bias="bias" in child)
        elif isinstance(child, nn.QuantizedEmbedding):
            twin = nn.Embedding(1, 1)
        elif isinstance(child, QuantizedSwitchLinear):
            twin = SwitchLinear(1, 1, 1, bias="bias" in child)
        else:
            continue
        # Built at a placeholder size, then given the real weight: nothing of the placeholder is evaluated.
        twin.weight = mx.dequantize(child.weight, child.scales, getattr(child, "biases", None), child.group_size,
                                    child.bits, child.mode)
        if "bias" in child:
            twin.bias = child.bias
        dense.append((name, twin))
        replaced.append((name, child))
    if dense:
        module.update_modules(tree_unflatten(dense))
    return replaced


def _is_quantized(module: nn.Module) -> bool:
    """A quantized Linear, Embedding or expert stack (mlx-lm's ``QuantizedSwitchLinear``)."""
    return isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)) or (
        hasattr(module, "bits") and "scales" in module)


def _flat_parameters(module: nn.Module) -> list[tuple[str, mx.array]]:
    """``(dotted name, array)`` for each of the module's parameters."""
    # mlx annotates tree_flatten as returning a list or a dict; without ``destination`` it is the list.
    return tree_flatten(module.parameters())  # type: ignore[return-value]


def _local_name(name: str, layers: LayerRange) -> str:
    """``model.layers.12.x`` -> ``layers.2.x`` for a stage starting at 10; drop the ``model.`` prefix."""
    if name.startswith("model.layers."):
        index, rest = name[len("model.layers."):].split(".", 1)
        return f"layers.{int(index) - layers.start}.{rest}"
    return name.removeprefix("model.")


def _global_path(path: str, layers: LayerRange) -> str:
    if path.startswith("layers."):
        index, rest = path[len("layers."):].split(".", 1)
        return f"model.layers.{int(index) + layers.start}.{rest}"
    if path == "lm_head" or path.startswith("lm_head."):
        return path
    return f"model.{path}"
