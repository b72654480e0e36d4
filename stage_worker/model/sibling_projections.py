"""Sibling projections of mlx-lm's own layers, computed as one matmul where that saves kernels.

``join_sibling_projections(layer)`` rewrites one loaded mlx-lm decoder layer in place, whatever its
architecture: each group of projections the model's code feeds the same input (``QKV``: q/k/v of an
attention; ``GATE_UP``: gate/up of an MLP, a shared expert or a ``SwitchGLU``'s experts) whose parts are all
one kind of layer in one format becomes one joined child (``qkv_proj`` / ``gate_up_proj``, the same bytes),
and each part a ``ProjectionPart`` the model's own code calls where it called the part; any other group stays
as it is. ``joined_experts`` gives ``expert_routing`` a ``SwitchGLU``'s joined experts. It serves the layers
mlx-lm runs as they are (``layer_stack``); ``packed_forward``'s own layers join through ``fused_projections``.

Every output element is the same dot product as in the separate layer; a GEMM library may block a wider
matrix differently, so single-row and expert results can differ from the separate layers' in the last bits
(on CUDA, and on the CPU with an optimized BLAS). Every stage of a pipeline joins alike.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

# The groups, each as (the joined child's name, the parts' names in the order their columns are joined).
QKV = ("qkv_proj", ("q_proj", "k_proj", "v_proj"))
GATE_UP = ("gate_up_proj", ("gate_proj", "up_proj"))
GROUPS = (QKV, GATE_UP)

_EXPERT_KINDS = (SwitchLinear, QuantizedSwitchLinear)
_KINDS = (nn.Linear, nn.QuantizedLinear, *_EXPERT_KINDS)
# A layer's arrays that run along its output, and the axis they run along counted from their end: the
# matrices (weight, and a quantized weight's scales and biases) by their rows, the bias by its length.
_OUTPUT_AXIS_FROM_END = {"weight": 2, "scales": 2, "biases": 2, "bias": 1}


@dataclass(frozen=True)
class JoinedGroups:
    """What ``join_sibling_projections`` joined in one layer: attention q/k/v groups, gate/up groups."""

    qkv: int
    gate_up: int


class _SharedProduct:
    """A group's joined layer, its last product and the parts' own views of its weights.

    A plain object, not a module: the joined layer is counted once, as its parent's child, and the views
    share its memory. Not locked: a model's forward is built on one thread (a stage's engine thread)."""

    def __init__(self, joined: nn.Module, bounds: Sequence[tuple[int, int]]) -> None:
        self.joined = joined
        self.bounds = list(bounds)
        # Expert parts always take columns of the joined product; plain parts multiply by their own rows on
        # more than one row of input.
        self.own = [] if isinstance(joined, _EXPERT_KINDS) else [_rows_of(joined, start, end)
                                                                  for start, end in self.bounds]
        self._inputs: tuple[Any, ...] | None = None
        self._product: mx.array | None = None
        self._left = 0

    def product(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> mx.array:
        """The joined layer on ``inputs``, computed once for the group's parts called on the same arrays."""
        if self._left == 0 or self._inputs is None or not _same(inputs, self._inputs):
            self._inputs, self._product, self._left = inputs, self.joined(*inputs, **kwargs), len(self.bounds)
        product = self._product
        assert product is not None
        self._left -= 1
        if self._left == 0:  # every part has its columns: let go of the step's arrays
            self._inputs = self._product = None
        return product


class ProjectionPart(nn.Module):
    """One part of a joined group, called where the model calls the separate layer (module contract).

    A part computes the joined layer once for its group and returns its own columns of that product: the
    other parts of the group called on the same input arrays (the same objects) take theirs from the same
    product. Expert parts always do; parts of plain linear layers do so for a single row (one sequence
    decoding a token), and on more rows multiply by their own rows of the joined weights (views, no copies),
    exactly as the separate layer did: there a column slice is strided across rows, and the model's reshapes
    to heads and its norms could copy it back (unmeasured; ``packed_forward`` avoids it by splitting by
    heads)."""

    def __init__(self, shared: _SharedProduct, index: int, always_joined: bool) -> None:
        super().__init__()
        self._shared = shared
        self._index = index
        self._always_joined = always_joined

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        if self._always_joined or x.size == x.shape[-1]:
            start, end = self._shared.bounds[self._index]
            return self._shared.product((x, *args), kwargs)[..., start:end]
        return self._shared.own[self._index](x, *args, **kwargs)


def join_sibling_projections(layer: nn.Module) -> JoinedGroups:
    """Join every group of sibling projections under ``layer`` in place (see the module's contract); returns
    which groups it joined.

    A group joins where its parts are all one kind of layer in one format (``nn.Linear``,
    ``nn.QuantizedLinear``, mlx-lm's ``SwitchLinear`` or ``QuantizedSwitchLinear``): the joined child holds
    the parts' arrays concatenated along the output. A group that is not (a bias on some parts only, other
    bits or group sizes, a per-expert global scale, another layer type such as LoRA) stays as it is. On a
    GPU one decoding sequence's step is bound by the host launching a kernel per op (on CUDA without graphs,
    as a stage runs): joining q/k/v removes two matmuls of each attention layer, joining gate/up one of each
    MLP or expert block (two gathered matmuls become one). docs/performance.md has the figures."""
    counts = {QKV[0]: 0, GATE_UP[0]: 0}
    for _, module in list(layer.named_modules()):
        for joined_name, part_names in GROUPS:
            if joined_name in module or not all(name in module for name in part_names):
                continue
            parts = [module[name] for name in part_names]
            joined = joined_layer(parts)
            if joined is None:
                continue
            mx.eval(joined.parameters())  # layer by layer, so the parts' memory is freed as we go
            widths = [_output_width(p) for p in parts]
            bounds = [(sum(widths[:i]), sum(widths[: i + 1])) for i in range(len(widths))]
            shared = _SharedProduct(joined, bounds)
            mx.eval([own.parameters() for own in shared.own])  # views of the joined arrays: no new memory
            always = not shared.own
            setattr(module, joined_name, joined)
            for index, name in enumerate(part_names):
                setattr(module, name, ProjectionPart(shared, index, always))
            counts[joined_name] += 1
    return JoinedGroups(qkv=counts[QKV[0]], gate_up=counts[GATE_UP[0]])


def joined_layer(parts: Sequence[nn.Module]) -> nn.Module | None:
    """One layer of the parts' kind computing the parts one after another along the output, or None where
    they differ in kind, format, dtype or which arrays they carry (lazy: the caller evaluates it)."""
    kinds = {type(p) for p in parts}
    if len(kinds) != 1 or kinds.pop() not in _KINDS:
        return None
    keys = {tuple(sorted(k for k, v in p.items() if isinstance(v, mx.array))) for p in parts}
    if len(keys) != 1:
        return None
    names = keys.pop()
    if any(name not in _OUTPUT_AXIS_FROM_END for name in names):  # a per-expert global scale, say
        return None
    formats = {(getattr(p, "group_size", None), getattr(p, "bits", None), getattr(p, "mode", None)) for p in parts}
    dtypes = {tuple(p[name].dtype for name in names) for p in parts}
    if len(formats) != 1 or len(dtypes) != 1:
        return None
    joined = copy.copy(parts[0])  # the same class and settings; its arrays replaced below
    for name in names:
        axis = parts[0][name].ndim - _OUTPUT_AXIS_FROM_END[name]
        arrays = [p[name] for p in parts]
        other_dims = {a.shape[:axis] + a.shape[axis + 1 :] for a in arrays}
        if len(other_dims) != 1:
            return None
        joined[name] = mx.concatenate(arrays, axis=axis)
    return joined


def joined_experts(block: nn.Module) -> nn.Module | None:
    """The joined gate/up experts of a ``SwitchGLU`` (``[experts, 2 * hidden, in]``: each expert's gate rows,
    then its up rows), or None if its gate and up are separate."""
    joined = block.get(GATE_UP[0])
    return joined if isinstance(joined, _EXPERT_KINDS) else None


def _output_width(part: nn.Module) -> int:
    weight = part["weight"]
    return int(weight.shape[weight.ndim - 2])


def _rows_of(joined: nn.Module, start: int, end: int) -> nn.Module:
    """A layer computing output ``[start, end)`` of ``joined`` with views of its arrays."""
    own = copy.copy(joined)
    for name in [k for k, v in joined.items() if isinstance(v, mx.array)]:
        array = joined[name]
        axis = array.ndim - _OUTPUT_AXIS_FROM_END[name]
        index = tuple([slice(None)] * axis + [slice(start, end)])
        own[name] = array[index]
    return own


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


__all__ = ["GATE_UP", "QKV", "JoinedGroups", "ProjectionPart", "join_sibling_projections", "joined_experts",
           "joined_layer"]
