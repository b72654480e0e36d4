"""Tensor parallelism inside a stage: which slice of each layer a group member holds, and the slicing itself.

The packed path (llama / qwen2 / qwen3, full attention): ``split_layer`` decides (pure) member ``rank``'s run of
whole KV-head groups (each KV head with the query heads that read it) and part of the MLP's intermediate size,
as even as the counts allow, the MLP leaning away from rank 0's whole head (``balance_intermediate``);
``shard_layers`` keeps q/k/v's and gate/up's rows, o_proj's and down_proj's columns as ``AllSumLinear`` (the
partial product summed over the group, the bias added by rank 0). The layer stack: ``shard_model`` cuts evenly,
by mlx-lm's own ``Model.shard`` or, where mlx-lm has none, ``SHARDERS``' cut written as mlx-lm writes its own
(qwen3_next, gemma3_text, mixtral): mlx's ``shard_linear`` / ``shard_inplace``, "all-to-sharded" rows out of the
hidden state, "sharded-to-all" columns back into it, experts by their intermediate size and summed once by their
block, qwen3_next's GatedDeltaNet by whole key-head groups (``linear_attention_heads``); ``even_share`` refuses a
size that does not divide the cut's ``divided_counts``. Either way one all-reduce per attention and one per MLP;
norms, routers, embedding and head stay whole; each member's caches hold only its heads. A split the model
cannot take raises ``UserError`` naming what would work.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import shard_inplace, shard_linear
from mlx_lm.models.mixtral import MixtralSparseMoeBlock

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
    """Member ``rank``'s share where the split must be even (mlx-lm's own ``shard()`` and ``SHARDERS``' cuts,
    which divide every count by ``size``): refused, naming the sizes that would work, where a count does
    not divide (pure). ``counts``: the model's counts the cut divides, by name (``divided_counts``);
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
    must pass the same, since it moves the MLP's split (``balance_intermediate``). The cuts stay lazy: the
    caller evaluates them layer by layer (``StageModel.shard``), so lazily loaded weights are read only as
    they are cut."""
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
    if share is None:
        raise UserError("a tensor-parallel stage needs at least one decoder layer")
    return share


# ----- the layer stack's even cuts (``shard_model``)


@dataclass(frozen=True)
class LinearAttentionHeads:
    """A member's GatedDeltaNet heads: a contiguous run of key heads and the value heads grouped under them."""

    key_heads: range
    value_heads: range


def linear_attention_heads(key_heads: int, value_heads: int, size: int, rank: int) -> LinearAttentionHeads:
    """Member ``rank``'s key heads and value heads of a GatedDeltaNet (pure). Qwen3-Next packs its q/k/v/z and
    b/a projections per key-head group (each key head's q and k rows, then the rows of the value heads that
    read it), so an even run of whole key-head groups is also a contiguous run of rows of each packed
    projection, and of value heads; that is what mlx's contiguous "all-to-sharded" cut keeps."""
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"rank {rank} of a group of {size}")
    if value_heads % key_heads:
        raise UserError(f"{value_heads} linear-attention value heads do not divide into {key_heads} key heads")
    if key_heads % size:
        raise UserError(f"-tp {size} does not divide the model's {key_heads} linear-attention key heads")
    per_key = value_heads // key_heads
    keys = key_heads // size
    return LinearAttentionHeads(range(rank * keys, (rank + 1) * keys),
                                range(rank * keys * per_key, (rank + 1) * keys * per_key))


def _qwen3_next_counts(args: Mapping[str, Any]) -> dict[str, str]:
    counts = {"attention heads": "num_attention_heads", "KV heads": "num_key_value_heads",
              "linear-attention key heads": "linear_num_key_heads",
              "linear-attention value heads": "linear_num_value_heads",
              "experts' intermediate size": "moe_intermediate_size",
              "shared expert's intermediate size": "shared_expert_intermediate_size"}
    layers = int(args.get("num_hidden_layers") or 0)
    step = int(args.get("decoder_sparse_step") or 1)
    dense_only = set(args.get("mlp_only_layers") or [])
    experts = int(args.get("num_experts") or 0)
    if any(i in dense_only or experts == 0 or (i + 1) % step for i in range(layers)):
        counts["intermediate size"] = "intermediate_size"  # only a dense layer's MLP is cut by it
    return counts


# Attention that caches one latent for every head (DeepSeek's MLA, mlx-lm's deepseek_v3): a member keeps the whole
# latent whatever heads it computes, so its cache is not cut.
LATENT_KV_ARCHITECTURES: tuple[str, ...] = ("deepseek_v3",)


def kv_part_held(model_type: str, args: Mapping[str, Any], share: LayerShare) -> tuple[int, int]:
    """``(held, of)``: the part of each KV layer's per-position keys and values a member of ``share`` keeps
    (pure; ``StageKV.share`` takes it): its KV heads of the model's, or the whole latent. Every cut here and
    mlx-lm's ``shard()`` divide the KV heads of the caches they leave (tests/test_tensor_parallel.py checks each
    cached array's head axis halves at -tp 2); a recurrent state is counted whole, an upper bound."""
    if model_type in LATENT_KV_ARCHITECTURES:
        return 1, 1
    return len(share.kv_heads), int(args.get("num_key_value_heads") or args["num_attention_heads"])


def divided_counts(model_type: str, args: Mapping[str, Any]) -> dict[str, int]:
    """The counts of this model a ``-tp`` must divide, by name (pure): the cut's own (``SHARDERS``) or
    mlx-lm's (``MLX_LM_COUNTS``)."""
    if model_type == "qwen3_next":
        fields: Mapping[str, str] = _qwen3_next_counts(args)
    elif model_type == "mixtral":  # its ``intermediate_size`` is each expert's
        fields = {"attention heads": "num_attention_heads", "KV heads": "num_key_value_heads",
                  "experts' intermediate size": "intermediate_size"}
    elif model_type == "gemma3_text":
        fields = {"attention heads": "num_attention_heads", "KV heads": "num_key_value_heads",
                  "intermediate size": "intermediate_size"}
    else:
        fields = MLX_LM_COUNTS
    counts = {name: int(args[key]) for name, key in fields.items() if args.get(key)}
    if "KV heads" not in counts and "attention heads" in counts:  # no KV-head count: one KV head per head
        counts["KV heads"] = counts["attention heads"]
    return counts


# ----- the pieces every cut is made of (mlx's shard_linear / shard_inplace, as mlx-lm's shard() uses them)


def _whole_groups(module: nn.Module, n: int) -> None:
    """Refuse a column cut of a quantized layer (linear or experts) that would split a quantization group:
    mlx's cut splits the scales by the group's size, so each member's columns must be whole groups."""
    if "scales" in module and module.scales.shape[-1] % n:
        groups = module.scales.shape[-1]
        raise UserError(f"-tp {n} splits a quantization group of {module.group_size} in a projection of "
                        f"{groups * module.group_size} input features: use a -tp that divides {groups}, or dense "
                        "weights")


def _sharded_to_all(linear: nn.Module, group: Any) -> nn.Module:
    """``linear`` cut by its input features, its partial products summed over the group (a new layer)."""
    _whole_groups(linear, group.size())
    return shard_linear(linear, "sharded-to-all", group=group)


def _attention(attn: nn.Module, group: Any, heads: str, kv_heads: str) -> None:
    """q/k/v by their rows (whole heads: each member's heads, with the KV heads they read), o_proj by its
    columns and summed; the module's head counts (attributes ``heads`` and ``kv_heads``) divided, as mlx-lm's
    llama ``shard`` does."""
    n = group.size()
    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(attn, name, shard_linear(getattr(attn, name), "all-to-sharded", group=group))
    attn.o_proj = _sharded_to_all(attn.o_proj, group)
    setattr(attn, heads, getattr(attn, heads) // n)
    setattr(attn, kv_heads, getattr(attn, kv_heads) // n)


def _dense_mlp(mlp: nn.Module, group: Any) -> None:
    """gate/up by their rows (the member's intermediate features), down by its columns and summed."""
    mlp.gate_proj = shard_linear(mlp.gate_proj, "all-to-sharded", group=group)
    mlp.up_proj = shard_linear(mlp.up_proj, "all-to-sharded", group=group)
    mlp.down_proj = _sharded_to_all(mlp.down_proj, group)


def _glu_inplace(glu: nn.Module, group: Any) -> None:
    """A GLU's (an expert block's ``SwitchGLU`` or a shared expert's) weights cut in place by the intermediate
    size; no sum of its own: the enclosing block sums its output once (``sharding_group``)."""
    shard_inplace(glu.gate_proj, "all-to-sharded", group=group)
    shard_inplace(glu.up_proj, "all-to-sharded", group=group)
    _whole_groups(glu.down_proj, group.size())
    shard_inplace(glu.down_proj, "sharded-to-all", group=group)


# ----- gemma3_text: sliding-window and global attention layers, dense GELU MLP


def _shard_gemma3_text(model: nn.Module, group: Any) -> None:
    # Sliding or global, a layer's attention is the same module (the window is its cache's); q_norm and k_norm
    # normalise each head alone, so they stay whole. ``repeats`` (heads per KV head) is unchanged by an even cut.
    for layer in model.model.layers:
        _attention(layer.self_attn, group, "n_heads", "n_kv_heads")
        _dense_mlp(layer.mlp, group)


# ----- mixtral: attention, and experts (``SwitchGLU``) routed by a whole router


class SummedMixtralMoe(MixtralSparseMoeBlock):
    """mlx-lm's Mixtral expert block with its experts cut by their intermediate size: the member's partial
    output summed over the group, as mlx-lm's qwen3_moe block does with its ``sharding_group``. A class
    change, not a wrapper, so the parameters keep their names (the planner and weight checks count them by
    name) and the model's own code calls the block where it is."""

    sharding_group: Any = None

    def __call__(self, x: mx.array) -> mx.array:
        return mx.distributed.all_sum(super().__call__(x), group=self.sharding_group)


def _shard_mixtral(model: nn.Module, group: Any) -> None:
    for layer in model.model.layers:
        _attention(layer.self_attn, group, "num_heads", "num_key_value_heads")
        block = layer.block_sparse_moe
        # The router stays whole: every member picks the same experts for a row, and computes its part of each.
        _glu_inplace(block.switch_mlp, group)
        block.__class__ = SummedMixtralMoe
        block.sharding_group = group


# ----- qwen3_next: gated full attention, GatedDeltaNet linear attention, experts with a shared expert


def _shard_gated_delta_net(net: nn.Module, group: Any) -> None:
    """A GatedDeltaNet cut by whole key-head groups (``linear_attention_heads``). in_proj_qkvz and in_proj_ba
    are packed per key-head group, so their contiguous rows are the member's groups; the convolution runs over
    [q of every key head | k of every key head | v of every value head], so each of those three segments is
    cut alike (mlx-lm's qwen3_5 cut); A_log and dt_bias are per value head; the gated norm is per head (one
    weight for all heads: whole); out_proj reads the member's value heads, and is summed."""
    n, rank = group.size(), group.rank()
    heads = linear_attention_heads(net.num_k_heads, net.num_v_heads, n, rank)
    key_dim = net.key_dim
    net.in_proj_qkvz = shard_linear(net.in_proj_qkvz, "all-to-sharded", group=group)
    net.in_proj_ba = shard_linear(net.in_proj_ba, "all-to-sharded", group=group)
    shard_inplace(net.conv1d, lambda path, weight: (0, [key_dim, 2 * key_dim]), group=group)
    net.conv1d.groups //= n  # depthwise: one group per channel
    net.A_log = mx.contiguous(net.A_log[heads.value_heads.start:heads.value_heads.stop])
    net.dt_bias = mx.contiguous(net.dt_bias[heads.value_heads.start:heads.value_heads.stop])
    net.out_proj = _sharded_to_all(net.out_proj, group)
    net.num_k_heads, net.num_v_heads = len(heads.key_heads), len(heads.value_heads)
    net.key_dim //= n
    net.value_dim //= n
    net.conv_dim //= n


def _shard_qwen3_next(model: nn.Module, group: Any) -> None:
    for layer in model.model.layers:
        if layer.is_linear:
            _shard_gated_delta_net(layer.linear_attn, group)
        else:
            # q_proj's rows are per head [query | gate], head after head: whole heads stay together.
            _attention(layer.self_attn, group, "num_attention_heads", "num_key_value_heads")
        mlp = layer.mlp
        if "switch_mlp" in mlp:
            # mlx-lm's block sums its output over ``sharding_group``: routed experts plus the shared expert,
            # whose sigmoid gate (a whole projection of the whole input) scales every member's part alike.
            _glu_inplace(mlp.switch_mlp, group)
            _glu_inplace(mlp.shared_expert, group)
            mlp.sharding_group = group
        else:
            _dense_mlp(mlp, group)


SHARDERS: Mapping[str, Callable[[nn.Module, Any], None]] = {
    "qwen3_next": _shard_qwen3_next,
    "gemma3_text": _shard_gemma3_text,
    "mixtral": _shard_mixtral,
}


def _mlx_lm_shards(model_type: str) -> bool:
    arch = importlib.import_module(f"mlx_lm.models.{model_type}")
    return hasattr(arch.Model, "shard")


def shardable(model_type: str) -> bool:
    """Whether ``model_type`` has a tensor-parallel cut: mlx-lm's own, or ours."""
    return model_type in SHARDERS or _mlx_lm_shards(model_type)


def shard_model(model: nn.Module, model_type: str, group: Any) -> None:
    """Cut mlx-lm's loaded ``model`` to this member's share of ``group`` in place (module docstring)."""
    if hasattr(model, "shard"):
        try:
            model.shard(group)
        except ValueError as exc:  # mlx's cut of a quantized projection whose parts would split its groups
            raise UserError(f"-tp {group.size()} cannot cut {model_type}'s quantized weights: {exc}. Use a -tp "
                            "whose parts keep whole quantization groups, or dense weights (--dequantize on)") from exc
    elif model_type in SHARDERS:
        SHARDERS[model_type](model, group)
    else:
        raise UserError(f"-tp {group.size()}: no tensor-parallel sharding for {model_type} (mlx-lm has none, nor "
                        "stagemesh); serve it with -pp (pipeline stages) instead")
