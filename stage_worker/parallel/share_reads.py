"""A tensor-parallel member's share read from the files alone: what the cut keeps of each tensor is traced
first, then only that part is read.

- ``trace_cut(module, cut)`` runs the member's ``cut`` (any of ``tensor_parallel``'s, or mlx-lm's own
  ``shard()``, all of which replace or slice a module's parameters in place) on structural copies of
  ``module`` whose parameters are index probes: along one axis at a time, every element holds its index along
  that axis (offset per parameter, so the source is known too). What a cut parameter then holds says, axis by
  axis, which indices of which parameter it kept. A cut that is not such a selection (a sum, a transpose) is
  not traced, and that parameter is read whole as before. Probes are broadcasts: nothing of the model's size
  is made, only each cut part's own indices.
- ``read_kept(source, kept)`` reads that part from the files: a safetensors ``StoredTensor`` as stored, a GGUF
  tensor's converted array from its blocks (``StoredGGUF``), or a quantized triple dequantized as the stage
  does (``DequantizedSource``), then cast as the parameter was: the very array that reading the whole tensor
  and cutting it gives (tests/test_tensor_parallel.py). A GGUF member holds placeholders until then, so
  ``read_cut_parts`` also reads whole what the cut left whole, and refuses a cut it could not trace.
"""

from __future__ import annotations

import bisect
import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from stage_worker.checkpoint.gguf.format import StoredGGUF, forget_converted_parts, read_gguf_part
from stage_worker.checkpoint.model_spec import ModelFormatError
from stage_worker.checkpoint.safetensors_format import StoredTensor, read_part, runs_of


@dataclass(frozen=True)
class Kept:
    """What a cut parameter holds: along each axis of parameter ``source`` (named as before the cut), the index
    runs kept, in order; ``dtype`` the source's as the stage held it before the cut."""

    source: str
    keep: tuple[tuple[range, ...], ...]
    dtype: mx.Dtype


Stored = StoredTensor | StoredGGUF


@dataclass(frozen=True)
class DequantizedSource:
    """A dense weight the stage made from a stored quantized one (``StageModel.dequantize``): its codes,
    scales and biases as stored, the scales and biases cast to ``scales_dtype`` first, as the stage held them."""

    weight: Stored
    scales: Stored
    biases: Stored | None
    scales_dtype: mx.Dtype
    group_size: int
    bits: int
    mode: str


Source = StoredTensor | StoredGGUF | DequantizedSource


def placeholder(source: Source) -> bool:
    """Whether the parameter loaded from ``source`` holds no data until read (a GGUF's: ``load_gguf_weights``)."""
    return isinstance(source.weight if isinstance(source, DequantizedSource) else source, StoredGGUF)


def trace_cut(module: nn.Module, cut: Callable[[nn.Module], Any]) -> dict[str, Kept]:
    """``{name after the cut: Kept}`` for each parameter ``cut`` replaced by a selection of one parameter's
    indices (module docstring); ``module`` itself is left as it is. Each axis is probed once, and the first
    once more with every index moved by ``_SHIFT``: a selection moves alike, a cut that computes on the
    parameter (gpt-oss's expert bias divided by the group's size) does not, and is left untraced."""
    before = [(n, a) for n, a in _parameters(module) if a.ndim]
    ndim = max((a.ndim for _, a in before), default=0)
    try:
        seen = [_probed(module, cut, before, axis, 0) for axis in range(ndim)]
        shifted = _probed(module, cut, before, 0, _SHIFT) if ndim else ({}, [])
    except _TooManyIndices:
        return {}
    except (ValueError, TypeError, RuntimeError):  # a cut that refuses probes (integer division): none traced
        return {}
    kept = {}
    for name, first in seen[0][0].items() if seen else ():
        moved = shifted[0].get(name)
        if first is None or moved is None or not np.array_equal(moved, first + _SHIFT):
            continue
        k = bisect.bisect_right(seen[0][1], int(first[0])) - 1
        source, array = before[k]
        vectors = []
        for axis in range(array.ndim):
            indices, bases = seen[axis][0].get(name), seen[axis][1]
            if indices is None:
                break
            local = indices - bases[k]
            if int(local.min()) < 0 or int(local.max()) >= array.shape[axis]:
                break
            vectors.append(local)
        if len(vectors) != array.ndim:
            continue
        try:
            keep = tuple(runs_of([int(i) for i in v]) for v in vectors)
        except ValueError:  # reordered indices: not a cut this reads
            continue
        kept[name] = Kept(source, keep, array.dtype)
    return kept


# Probe values are exact in float32 below 2**24: indices, moved by the shift, stay under it.
_SHIFT = 1 << 22
_EXACT = 1 << 24


class _TooManyIndices(Exception):
    """The model's axes are too long to probe exactly: nothing is traced, everything read whole."""


def _probed(module: nn.Module, cut: Callable[[nn.Module], Any], before: list[tuple[str, mx.array]], axis: int,
            shift: int) -> tuple[dict[str, np.ndarray | None], list[int]]:
    """``cut`` run on a copy of ``module`` probed along ``axis``: for each parameter it changed, the probe
    values it holds along that axis (None where they differ along another: not a selection); and the bases
    of the parameters' probes, in ``before``'s order."""
    twin = _structural_copy(module)
    probes, bases, base = [], [], 0
    for name, array in before:
        probes.append((name, _probe(array, axis, base + shift)))
        bases.append(base)
        base += array.shape[axis] if axis < array.ndim else 1
    if base + shift >= _EXACT:
        raise _TooManyIndices
    twin.update(tree_unflatten(probes))
    cut(twin)
    untouched = {id(p) for _, p in probes}
    changed = {name: _indices_along(held, axis) for name, held in _parameters(twin)
               if id(held) not in untouched and held.ndim > axis and held.size}
    return changed, bases


def read_kept(source: Source, kept: Kept) -> mx.array:
    """The part ``kept`` of ``source``, read alone, in the dtype the stage held it (module docstring)."""
    if not isinstance(source, DequantizedSource):
        return _read(source, kept.keep).astype(kept.dtype)
    *outer, last = kept.keep
    group, bits = source.group_size, source.bits
    # Whole groups are read and dequantized (each alone), then the kept columns cut from them.
    wide = tuple(range(r.start // group * group, -(-r.stop // group) * group) for r in last)
    words = tuple(range(r.start * bits // 32, r.stop * bits // 32) for r in wide)
    groups = tuple(range(r.start // group, r.stop // group) for r in wide)
    scales = _read(source.scales, (*outer, groups)).astype(source.scales_dtype)
    biases = None if source.biases is None else _read(source.biases, (*outer, groups)).astype(source.scales_dtype)
    dense = mx.dequantize(_read(source.weight, (*outer, words)), scales, biases, group, bits, source.mode)
    if wide != last:
        pieces, offset = [], 0
        for w, r in zip(wide, last):
            pieces.append(dense[..., offset + r.start - w.start:offset + r.stop - w.start])
            offset += len(w)
        dense = mx.concatenate(pieces, axis=-1)
    return dense.astype(kept.dtype)


def _read(source: Stored, keep: tuple[tuple[range, ...], ...]) -> mx.array:
    return read_part(source, keep) if isinstance(source, StoredTensor) else read_gguf_part(source, keep)


def whole(source: Source, dtype: mx.Dtype) -> Kept:
    """All of ``source``, as a ``Kept`` (what a parameter the cut left whole reads)."""
    shape = source.weight.shape if isinstance(source, DequantizedSource) else source.shape
    if isinstance(source, DequantizedSource):
        shape = (*shape[:-1], shape[-1] * 32 // source.bits)
    return Kept("", tuple((range(n),) for n in shape), dtype)


def read_cut_parts(module: nn.Module, kept: Mapping[str, Kept], sources: Mapping[str, Source],
                   left_whole: Mapping[str, str]) -> int:
    """Replace each traced parameter of ``module`` (after its cut) whose source lies in the files by the part
    read alone, and each one the cut ``left_whole`` (name after -> before) whose source is a placeholder by
    all of it; how many bytes of parameters were so read."""
    held = dict(_parameters(module))
    parts = []
    for name, k in kept.items():
        if name in held and (source := sources.get(k.source)) is not None:
            parts.append((name, read_kept(source, k)))
    for name, before in left_whole.items():
        if name in held and (source := sources.get(before)) is not None and placeholder(source):
            parts.append((name, read_kept(source, whole(source, held[name].dtype))))
    for name, part in parts:
        if part.shape != held[name].shape or part.dtype != held[name].dtype:
            raise ModelFormatError(f"{name}: read {part.shape} {part.dtype} from the files where the cut holds "
                                   f"{held[name].shape} {held[name].dtype}")
    if parts:
        module.update(tree_unflatten(parts))
    forget_converted_parts()  # the last GGUF part converted: its codes, scales and biases are all read now
    return sum(part.nbytes for _, part in parts)


def _parameters(module: nn.Module) -> list[tuple[str, mx.array]]:
    """``(dotted name, array)`` for each of the module's parameters."""
    # mlx annotates tree_flatten as returning a list or a dict; without ``destination`` it is the list.
    return tree_flatten(module.parameters())  # type: ignore[return-value]


def _probe(like: mx.array, axis: int, base: int) -> mx.array:
    """A broadcast array shaped as ``like`` holding ``base +`` each element's index along ``axis`` (just
    ``base`` where it has fewer axes): float32 for a floating parameter, so a cut may compute on it, uint32
    for codes."""
    dtype = mx.float32 if mx.issubdtype(like.dtype, mx.floating) else mx.uint32
    shape = like.shape
    if axis >= len(shape):
        return mx.broadcast_to(mx.array(base, dtype=dtype), shape)
    line = mx.arange(base, base + shape[axis], dtype=dtype)
    return mx.broadcast_to(line.reshape([-1 if i == axis else 1 for i in range(len(shape))]), shape)


def _indices_along(held: mx.array, axis: int) -> np.ndarray | None:
    """The probe indices ``held`` keeps along ``axis``, or None where they differ along another axis (the
    cut mixed elements: not a selection)."""
    others = tuple(i for i in range(held.ndim) if i != axis)
    low, high = (held.min(axis=others), held.max(axis=others)) if others else (held, held)
    mx.eval(low, high)
    low_np, high_np = np.array(low.astype(mx.float32), dtype=np.float64), np.array(high.astype(mx.float32),
                                                                                     dtype=np.float64)
    if not np.array_equal(low_np, high_np) or not np.array_equal(low_np, np.round(low_np)):
        return None
    return low_np.astype(np.int64)


def _structural_copy(value: Any) -> Any:
    """A copy of a module tree with modules, lists and dicts of its own and the same arrays: a cut run on it
    (attributes changed, modules replaced, parameters sliced) leaves the original as it was."""
    if isinstance(value, nn.Module):
        twin = copy.copy(value)
        for key, child in value.items():
            twin[key] = _structural_copy(child)
        return twin
    if isinstance(value, list):
        return [_structural_copy(v) for v in value]
    if isinstance(value, dict):
        return {k: _structural_copy(v) for k, v in value.items()}
    return value
