"""A model's size for the layer planner, from its spec alone (config and headers, never tensor data).

``model_facts(spec, dense=False)`` -> ``stagemesh_core.memory.ModelFacts``: the bytes of one decoder layer
(each layer at its own size where layers differ), of the embedding and of the head, and the KV per token per
layer, as a stage will hold them, so the facts of a slice are the bytes its stage holds. It reads the
architecture's shapes (``spec.args``) and the quantization map (``spec.quantization``), the same inputs
``stage_model`` loads by, so it works for ``--load-format dummy`` too. ``draft_facts(config, target,
max_num_seqs)`` -> ``stagemesh_core.memory.DraftFacts``: a draft model's weights and KV per position, counted
the same way, for the entry stage that holds it.

It lives here because which module is quantized how, and what shapes an architecture has, are the stage
worker's knowledge (``model_spec``, ``stage_model``); the coordinator may not import ``stage_worker``, so the
CLI computes the facts and hands the coordinator a core value.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from stage_worker.checkpoint.mlx_arch import PACKED_ARCHITECTURES, ArchFacts, exact_prefix_reuse
from stage_worker.checkpoint.model_spec import ModelSpec
from stage_worker.parallel.tensor_parallel import LATENT_KV_ARCHITECTURES
from stagemesh_core.memory import DraftFacts, LayerKV, ModelFacts, TensorBytes
from stagemesh_core.speculative import SpeculativeConfig


def _linear(spec: ModelSpec, path: str, out_features: int, in_features: int, dense: bool) -> TensorBytes:
    """A Linear or Embedding of shape (out, in): quantized with ``bits`` and ``group_size``, it holds
    ``out * in * bits / 8`` bytes of codes (whatever the compute dtype) plus, per group, in the affine mode a
    scale and a bias stored in the compute dtype like every dense weight and norm, in the fp modes (mxfp4,
    nvfp4, mxfp8) one uint8 scale (``TensorBytes``: packed bytes and elements)."""
    quant = None if dense else spec.quantization_for(path)
    if quant is None:
        return TensorBytes(0, out_features * in_features)
    codes = out_features * in_features * quant.bits // 8
    groups = out_features * in_features // quant.group_size
    if quant.has_biases:
        return TensorBytes(codes, 2 * groups)  # a scale and a bias per group, in the compute dtype
    return TensorBytes(codes + groups, 0)  # a uint8 scale per group


def _dims(args: Mapping[str, Any], hidden: int) -> tuple[int, int, int, int]:
    heads = int(args["num_attention_heads"])
    kv_heads = int(args.get("num_key_value_heads") or heads)
    head_dim = int(args.get("head_dim") or hidden // heads)
    intermediate = int(args["intermediate_size"])
    return heads, kv_heads, head_dim, intermediate


def _layer(spec: ModelSpec, index: int, dense: bool) -> TensorBytes:
    args, hidden = spec.args, spec.hidden_size
    heads, kv_heads, head_dim, intermediate = _dims(args, hidden)
    prefix = f"model.layers.{index}"
    shapes = {
        "self_attn.q_proj": (heads * head_dim, hidden), "self_attn.k_proj": (kv_heads * head_dim, hidden),
        "self_attn.v_proj": (kv_heads * head_dim, hidden), "self_attn.o_proj": (hidden, heads * head_dim),
        "mlp.gate_proj": (intermediate, hidden), "mlp.up_proj": (intermediate, hidden),
        "mlp.down_proj": (hidden, intermediate),
    }
    total = TensorBytes(0, 2 * hidden)  # input and post-attention norms
    for name, (out_features, in_features) in shapes.items():
        total += _linear(spec, f"{prefix}.{name}", out_features, in_features, dense)
    if spec.model_type == "qwen2" or args.get("attention_bias"):
        total += TensorBytes(0, (heads + 2 * kv_heads) * head_dim)  # q, k, v biases
    if spec.model_type == "qwen3":
        total += TensorBytes(0, 2 * head_dim)  # q_norm, k_norm
    return total


def model_facts(spec: ModelSpec, dense: bool = False) -> ModelFacts:
    """The planner's view of ``spec`` (see the module docstring): ``PACKED_ARCHITECTURES`` counted from their
    shapes, every other by ``_stack_facts``. With ``dense=True`` (``--dequantize on``) every weight counts as
    dense. Each layer is counted at its own size (``ModelFacts.layer_sizes`` where layers differ: a mixed
    recipe's 6-bit layers beside 4-bit ones)."""
    if spec.model_type not in PACKED_ARCHITECTURES:
        return _stack_facts(spec, dense)
    hidden, vocab = spec.hidden_size, spec.vocab_size
    _, kv_heads, head_dim, _ = _dims(spec.args, hidden)
    layers = [_layer(spec, i, dense) for i in range(spec.num_layers)]
    embedding = _linear(spec, "model.embed_tokens", vocab, hidden, dense)
    output = embedding if spec.tie_word_embeddings else _linear(spec, "lm_head", vocab, hidden, dense)
    return ModelFacts(
        num_layers=spec.num_layers, layer=_largest(layers), embedding=embedding,
        head=output + TensorBytes(0, hidden),  # the final norm
        kv_elements_per_token=2 * kv_heads * head_dim, tied_embeddings=spec.tie_word_embeddings,
        layer_sizes=_differing(layers),
    )


def draft_facts(config: SpeculativeConfig | None, target: ModelSpec, max_num_seqs: int,
                dense: bool = False) -> DraftFacts | None:
    """The entry stage's draft model (``--speculative-config``'s ``"model"``, already checked) as the planner and
    the stage count it: all its weights (as ``model_facts`` counts a model) and its KV per position; None
    without a draft model, or where ``target`` does not speculate (windows, recurrent state: no draft loads)."""
    if config is None or config.model is None or not exact_prefix_reuse(target):
        return None
    from stage_worker.checkpoint.model_reader import read_model_spec

    facts = model_facts(read_model_spec(config.model), dense)
    weights = facts.head if facts.tied_embeddings else facts.embedding + facts.head  # a tied matrix counts once
    for index in range(facts.num_layers):
        weights += facts.layer_sizes[index] if facts.layer_sizes else facts.layer
    return DraftFacts(weights, facts.slice_kv(0, facts.num_layers).per_token,
                      sequences=min(config.limit_for(None), max_num_seqs),
                      proposals=config.num_speculative_tokens)


def _largest(layers: list[TensorBytes]) -> TensorBytes:
    return max(layers, key=lambda t: (t.packed, t.elements))


def _differing(layers: list[TensorBytes]) -> tuple[TensorBytes, ...]:
    """Each layer's size where they are not all alike (``ModelFacts.layer_sizes``), else nothing."""
    return tuple(layers) if len(set(layers)) > 1 else ()


def _stack_facts(spec: ModelSpec, dense: bool) -> ModelFacts:
    """``model_facts`` for every other architecture (``mlx_arch.STACK_ARCHITECTURES``: experts, MLA, sliding
    windows, linear attention), measured on mlx-lm's own model, built lazily (shapes only, nothing allocated)
    and quantized exactly as the stage quantizes it, so its bytes are the stage's by construction: each
    layer's parameters (routed and shared experts, routers, dense first layers: ``ModelFacts.layer_sizes``
    where layers differ), the embedding, the head; each layer's KV (``ModelFacts.kv_layers`` where layers
    differ) by ``_measured_kv``."""
    import importlib

    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from stage_worker.checkpoint.mlx_arch import describe

    arch = importlib.import_module(f"mlx_lm.models.{spec.model_type}")
    model = arch.Model(arch.ModelArgs.from_dict(dict(spec.args)))
    facts = describe(spec.model_type, spec.args)
    if not dense:
        def quantized(path: str, module: nn.Module) -> dict[str, Any] | bool:
            params = spec.quantization_for(path) if hasattr(module, "to_quantized") else None
            return False if params is None else params.as_kwargs()

        nn.quantize(model, class_predicate=quantized)
    flat: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # type: ignore[assignment]

    def size(names: list[tuple[str, mx.array]]) -> TensorBytes:
        # Every floating parameter is cast to the compute dtype; the rest (uint32 codes, the fp modes' uint8
        # scales) keeps its size.
        floating = [a for _, a in names if mx.issubdtype(a.dtype, mx.floating)]
        return TensorBytes(sum(a.nbytes for _, a in names if not mx.issubdtype(a.dtype, mx.floating)),
                           sum(a.size for a in floating))

    layers = [size([(n, a) for n, a in flat if n.startswith(f"model.layers.{i}.")]) for i in range(spec.num_layers)]
    embedding = size([(n, a) for n, a in flat if n.startswith("model.embed_tokens.")])
    norm = size([(n, a) for n, a in flat if n.startswith("model.norm.")])
    head = embedding if spec.tie_word_embeddings or not facts.head_names else size(
        [(n, a) for n, a in flat if not n.startswith("model.")])
    kv_layers = _measured_kv(model, spec, facts)
    return ModelFacts(
        num_layers=spec.num_layers, layer=_largest(layers), embedding=embedding,
        head=head + norm, kv_elements_per_token=max((kv.per_token for kv in kv_layers), default=0),
        tied_embeddings=spec.tie_word_embeddings, layer_sizes=_differing(layers),
        kv_layers=() if all(kv == LayerKV(kv_layers[0].per_token) for kv in kv_layers) else kv_layers,
        kv_latent=spec.model_type in LATENT_KV_ARCHITECTURES,
    )


def _measured_kv(model: Any, spec: ModelSpec, facts: ArchFacts) -> tuple[LayerKV, ...]:
    """Each layer's KV from the caches of a one-token forward built (not evaluated) through every layer, in
    bfloat16: keys plus values per position of a KV layer (MLA's latent and rotary key for DeepSeek V3),
    bounded by the window of a sliding-window layer, and the arrays a linear-attention layer keeps per sequence
    whatever its length. A cache array in the compute dtype counts as elements, one kept in float32 whatever
    the compute dtype (Qwen3-Next's recurrent state; its convolution state is in the compute dtype) as fixed
    bytes."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from stage_worker.model.layer_stack import run_batch

    model.set_dtype(mx.bfloat16, lambda d: mx.issubdtype(d, mx.floating))
    caches = model.make_cache() if hasattr(model, "make_cache") else [KVCache() for _ in model.model.layers]
    run_batch(model.model.layers, mx.zeros((1, 1, spec.hidden_size), mx.bfloat16), caches, facts.array_masks)
    kv = []
    for cache, kind, window in zip(caches, facts.cache_kinds, facts.windows):
        if kind != "arrays":  # keys and values per position (MLA: the latent and the rotary key)
            per_token = cache.keys.shape[1] * cache.keys.shape[3] + cache.values.shape[1] * cache.values.shape[3]
            kv.append(LayerKV(per_token, window if kind == "rotating" else None))
        else:
            arrays = [a for a in cache.cache if a is not None]
            kv.append(LayerKV(state=TensorBytes(sum(a.nbytes for a in arrays if a.dtype == mx.float32),
                                                sum(a.size for a in arrays if a.dtype != mx.float32))))
    return tuple(kv)
