"""Tensor-parallel cuts of the layer-stack architectures: mlx-lm's own ``Model.shard`` where it has one, ours
(written as mlx-lm writes its own) for the served architectures it lacks: qwen3_next, gemma3_text, mixtral.

Contract:
* ``divided_counts(model_type, args)`` (pure): the model's counts, by name, that a ``-tp`` must divide for
  this architecture's cut (heads, KV heads, linear-attention key and value heads, intermediate sizes);
  ``tensor_parallel.even_share`` refuses a size that does not divide them, naming the sizes that would.
* ``shardable(model_type)``: whether the architecture has a cut (mlx-lm's or one of ``SHARDERS``).
* ``shard_model(model, model_type, group)`` cuts a loaded mlx-lm ``Model`` (its ``model.layers`` the stage's
  slice) to member ``group.rank()``'s share of ``group``, in place: mlx-lm's ``shard`` if the model has one,
  else ``SHARDERS[model_type]``. Raises ``UserError`` for an architecture with neither.
* ``linear_attention_heads(key_heads, value_heads, size, rank)`` (pure): which GatedDeltaNet key heads, and
  the value heads that read them, a member holds.

Every cut is even (each count divided by the group's size) and follows mlx-lm's own ``shard()`` methods
(llama, qwen3_moe, qwen3_5): projections that fan out from the layer's input are cut "all-to-sharded"
(rows: the member's heads or intermediate features), projections back into the hidden state "sharded-to-all"
(columns, the partial products summed over the group: one all-reduce per attention and one per MLP or expert
block); experts are cut in place by their intermediate size and summed by the block. Norms, routers, the
embedding and the head stay whole, so every member computes the same hidden state. A member's caches
(``KVCache``, ``RotatingKVCache``, ``ArraysCache``) take their shapes from its own heads, so each holds only
its share.
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

from stage_worker.model.tensor_parallel import MLX_LM_COUNTS
from stagemesh_core.errors import UserError


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
        model.shard(group)
    elif model_type in SHARDERS:
        SHARDERS[model_type](model, group)
    else:
        raise UserError(f"-tp {group.size()}: no tensor-parallel sharding for {model_type} (mlx-lm has none, nor "
                        "stagemesh); serve it with -pp (pipeline stages) instead")
