"""Tensor parallelism inside a stage: which slice of each layer a group member holds, and the slicing itself.

A group of ``size`` workers computes one stage together. ``split_layer`` decides (pure) what member ``rank``
holds: a contiguous run of KV-head groups (each KV head with the query heads that read it, so attention
never crosses members) and a contiguous part of the MLP's intermediate size, both as even as the counts
allow. ``shard_layers`` then cuts a loaded slice's dense decoder layers in place: q/k/v and gate/up keep
their rows (output features) of the member's share, o_proj and down_proj their columns (input features),
and those two become ``AllSumLinear``: the member's partial product summed over the group, with the bias
added by rank 0 only. Two all-reduces per layer; each member's KV cache holds only its own heads. Norms,
embedding and head stay whole on rank 0, so the MLP's split leans away from it (``balance_intermediate``).
Architectures on the layer stack shard evenly (``even_share``), by mlx-lm's own ``shard()`` or, where mlx-lm
has none, by ``arch_sharding``'s cuts written the same way.
A split the model cannot take raises ``UserError`` naming what would work.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from stagemesh_core.errors import UserError


@dataclass(frozen=True)
class LayerShare:
    """What member ``rank`` of a ``size``-worker group holds of one decoder layer."""

    rank: int
    size: int
    kv_heads: range  # this member's KV heads (global indices)
    heads: range  # the query heads that read them
    intermediate: range  # this member's part of the MLP's intermediate features


def _even_parts(total: int, size: int) -> list[range]:
    """``total`` items in ``size`` contiguous parts, the first ``total % size`` one item larger (pure)."""
    base, extra = divmod(total, size)
    parts, start = [], 0
    for rank in range(size):
        length = base + (1 if rank < extra else 0)
        parts.append(range(start, start + length))
        start += length
    return parts


def split_layer(n_heads: int, n_kv_heads: int, intermediate_size: int, size: int, rank: int) -> LayerShare:
    """Member ``rank``'s share of a layer with these counts (pure). Every member gets at least one KV head
    (with its query heads) and one intermediate feature; uneven counts give the first members one more."""
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"rank {rank} of a group of {size}")
    if n_heads % n_kv_heads:
        raise UserError(f"{n_heads} attention heads do not divide into {n_kv_heads} KV heads: not a model "
                        "tensor parallelism can split")
    if n_kv_heads < size:
        raise UserError(f"-tp {size} needs at least {size} KV heads to give each worker one, and the model has "
                        f"{n_kv_heads}: use -tp {n_kv_heads} or less")
    if intermediate_size < size:
        raise UserError(f"-tp {size} exceeds the MLP's intermediate size {intermediate_size}")
    per_kv = n_heads // n_kv_heads
    kv = _even_parts(n_kv_heads, size)[rank]
    return LayerShare(rank, size, kv, range(kv.start * per_kv, kv.stop * per_kv),
                      _even_parts(intermediate_size, size)[rank])


def balance_intermediate(intermediate_size: int, kv_parts: list[int], *, layers: int, per_kv_group: int,
                         per_feature: int, extra: list[int], align: int = 32) -> list[range]:
    """The MLP's intermediate features in contiguous parts, one per member, so that every member reads about
    as many weight elements per token (pure): a decode step waits for its slowest member, and a member's step
    is bound by the weights it reads. Member m holds ``kv_parts[m]`` KV groups of ``per_kv_group`` elements in
    each of ``layers`` layers, plus ``extra[m]`` (rank 0's whole head); each feature costs ``per_feature`` per
    layer. Parts are multiples of ``align`` (quantization groups stay whole) but for the last, and at least
    ``align`` each where the size allows; an even split where nothing needs balancing."""
    size = len(kv_parts)
    total = layers * (sum(kv_parts) * per_kv_group + intermediate_size * per_feature) + sum(extra)
    if not any(extra) and len(set(kv_parts)) == 1:
        return _even_parts(intermediate_size, size)
    floor = min(align, intermediate_size // size)
    wanted = []
    for m in range(size):
        room = total / size - layers * kv_parts[m] * per_kv_group - extra[m]
        wanted.append(max(floor, int(round(room / (layers * per_feature) / align)) * align))
    # What rounding left over goes to (or comes from) the last member, which keeps at least ``floor``.
    wanted[-1] = intermediate_size - sum(wanted[:-1])
    while wanted[-1] < floor:
        m = max(range(size - 1), key=lambda i: wanted[i])
        step = min(align, wanted[m] - floor, floor - wanted[-1])
        if step <= 0:
            return _even_parts(intermediate_size, size)
        wanted[m] -= step
        wanted[-1] += step
    parts, start = [], 0
    for length in wanted:
        parts.append(range(start, start + length))
        start += length
    return parts


# The counts mlx-lm's own even cuts divide (by name for messages -> config key; a key the config lacks is not
# a count of that model).
MLX_LM_COUNTS: Mapping[str, str] = {
    "attention heads": "num_attention_heads", "KV heads": "num_key_value_heads",
    "intermediate size": "intermediate_size", "experts' intermediate size": "moe_intermediate_size",
}


def even_share(args: Mapping[str, Any], size: int, rank: int, counts: Mapping[str, int] | None = None) -> LayerShare:
    """Member ``rank``'s share where the split must be even (mlx-lm's own ``shard()`` and ``arch_sharding``'s
    cuts, which divide every count by ``size``): refused, naming the sizes that would work, where a count does
    not divide (pure). ``counts``: the model's counts the cut divides, by name (``arch_sharding.divided_counts``);
    None: mlx-lm's heads, KV heads and intermediate sizes read from ``args``."""
    if counts is None:
        counts = {name: int(args[key]) for name, key in MLX_LM_COUNTS.items() if args.get(key)}
    uneven = {name: n for name, n in counts.items() if n % size}
    if uneven:
        works = [n for n in range(1, min(counts.values()) + 1) if all(c % n == 0 for c in counts.values())]
        raise UserError(f"-tp {size} does not divide the model's " + ", ".join(f"{n} {name}" for name, n in
                        uneven.items()) + f"; -tp {' or '.join(map(str, works))} would")
    heads = counts.get("attention heads", size)
    intermediate = counts.get("intermediate size") or counts.get("experts' intermediate size") or size
    return split_layer(heads, counts.get("KV heads", heads), intermediate, size, rank)


class AllSumLinear(nn.Module):
    """A projection cut by its input features: this member's partial product, summed over the group."""

    def __init__(self, inner: nn.Module, group: Any) -> None:
        super().__init__()
        self.inner = inner
        self._group = group  # underscore: not a parameter, never saved or cast
        # False only to time a member's compute alone (``stagemesh bench tensor``): the result is then wrong.
        self.summing = True

    def __call__(self, x: mx.array) -> mx.array:
        out = self.inner(x)
        return mx.distributed.all_sum(out, group=self._group) if self.summing else out


def _in_features(linear: nn.Module) -> int:
    """A (quantized) linear's input features."""
    if isinstance(linear, nn.QuantizedLinear):
        return linear.scales.shape[1] * linear.group_size
    return int(linear.weight.shape[1])


def _rows(linear: nn.Module, rows: range) -> None:
    """Keep output features ``rows`` of a (quantized) linear, in place."""
    for name in ("weight", "scales", "biases", "bias"):
        if name in linear and linear[name] is not None:
            setattr(linear, name, _own(linear[name][rows.start:rows.stop]))


def _own(part: mx.array) -> mx.array:
    """A cut as an array of its own: a slice is a strided view of the whole tensor, which a matmul would copy
    on every call (and which keeps the whole tensor alive)."""
    return mx.contiguous(part)


def _columns(linear: nn.Module, columns: range, keep_bias: bool) -> None:
    """Keep input features ``columns`` of a (quantized) linear, in place; its bias only where ``keep_bias``."""
    if isinstance(linear, nn.QuantizedLinear):
        group, bits = linear.group_size, linear.bits
        if columns.start % group or columns.stop % group:
            raise UserError(f"a tensor-parallel cut at input feature {columns.start}-{columns.stop} splits a "
                            f"quantization group of {group}: use a -tp that divides the heads and intermediate "
                            "size into whole groups, or dense weights")
        linear.weight = _own(linear.weight[:, columns.start * bits // 32:columns.stop * bits // 32])
        linear.scales = _own(linear.scales[:, columns.start // group:columns.stop // group])
        if linear.biases is not None:
            linear.biases = _own(linear.biases[:, columns.start // group:columns.stop // group])
    else:
        linear.weight = _own(linear.weight[:, columns.start:columns.stop])
    if "bias" in linear and not keep_bias:
        delattr(linear, "bias")


def shard_layers(layers: list[nn.Module], group: Any, rank_0_extra: int = 0) -> LayerShare:
    """Cut every dense decoder layer in ``layers`` (mlx-lm's llama / qwen2 / qwen3 layout, before
    ``fuse_projections``) to this member's share of ``group``, in place; the share taken. ``rank_0_extra``:
    the weight elements rank 0 reads per token beyond its layers (the head, on the last stage): every member
    must pass the same, since it moves the MLP's split (``balance_intermediate``)."""
    share = None
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        head_dim = attn.q_proj.weight.shape[0] // attn.n_heads if not isinstance(attn.q_proj, nn.QuantizedLinear) \
            else attn.q_proj.scales.shape[0] // attn.n_heads
        intermediate = mlp.gate_proj.weight.shape[0] if not isinstance(mlp.gate_proj, nn.QuantizedLinear) \
            else mlp.gate_proj.scales.shape[0]
        share = split_layer(attn.n_heads, attn.n_kv_heads, intermediate, group.size(), group.rank())
        if rank_0_extra or attn.n_kv_heads % group.size():
            hidden = _in_features(attn.q_proj)
            per_kv = attn.n_heads // attn.n_kv_heads
            kv_parts = [len(_even_parts(attn.n_kv_heads, group.size())[m]) for m in range(group.size())]
            parts = balance_intermediate(
                intermediate, kv_parts, layers=len(layers), per_kv_group=hidden * head_dim * (2 * per_kv + 2),
                per_feature=3 * hidden, extra=[rank_0_extra] + [0] * (group.size() - 1))
            share = LayerShare(share.rank, share.size, share.kv_heads, share.heads, parts[group.rank()])
        heads = range(share.heads.start * head_dim, share.heads.stop * head_dim)
        kv = range(share.kv_heads.start * head_dim, share.kv_heads.stop * head_dim)
        _rows(attn.q_proj, heads)
        _rows(attn.k_proj, kv)
        _rows(attn.v_proj, kv)
        _columns(attn.o_proj, heads, keep_bias=share.rank == 0)
        attn.o_proj = AllSumLinear(attn.o_proj, group)
        attn.n_heads, attn.n_kv_heads = len(share.heads), len(share.kv_heads)
        _rows(mlp.gate_proj, share.intermediate)
        _rows(mlp.up_proj, share.intermediate)
        _columns(mlp.down_proj, share.intermediate, keep_bias=share.rank == 0)
        mlp.down_proj = AllSumLinear(mlp.down_proj, group)
        mx.eval(layer.parameters())
    if share is None:
        raise UserError("a tensor-parallel stage needs at least one decoder layer")
    return share
