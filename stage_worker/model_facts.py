"""A model's size for the layer planner, from its spec alone (config and headers, never tensor data).

``model_facts(spec, dense=False)`` -> ``stagemesh.core.memory.ModelFacts``: the
bytes of one decoder layer, of the embedding and of the head, and the KV
elements per token per layer, as a stage will hold them. It is computed from
the architecture's shapes (``spec.args``) and the quantization map
(``spec.quantization``), the same inputs ``stage_model`` loads by, so it works
for ``--load-format dummy`` too and reads nothing but headers.

Why here and not in the coordinator: which module is quantized how, and what
shapes an architecture has, are the stage worker's knowledge (``model_spec``,
``stage_model``); the coordinator may not import ``stage_worker``, so the CLI
(which may) computes the facts and hands the coordinator a core value.

A quantized Linear or Embedding of shape (out, in) with ``bits`` and
``group_size`` holds ``out * in * bits / 8`` bytes of codes (whatever the
compute dtype) plus a scale and a bias per group, stored in the compute dtype
like every dense weight and norm (``TensorBytes``). With ``dense=True``
(``--dequantize on``) every weight counts as dense. Layers of mixed
quantization (a GGUF's Q4_K_M) count as the largest layer, so a plan never
undercounts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from stage_worker.model_spec import ModelSpec
from stagemesh.core.memory import ModelFacts, TensorBytes


def _linear(spec: ModelSpec, path: str, out_features: int, in_features: int, dense: bool) -> TensorBytes:
    quant = None if dense else spec.quantization_for(path)
    if quant is None:
        return TensorBytes(0, out_features * in_features)
    group_size, bits = quant
    groups = out_features * in_features // group_size
    return TensorBytes(out_features * in_features * bits // 8, 2 * groups)


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
    """The planner's view of ``spec`` (see the module docstring)."""
    hidden, vocab = spec.hidden_size, spec.vocab_size
    _, kv_heads, head_dim, _ = _dims(spec.args, hidden)
    layers = [_layer(spec, i, dense) for i in range(spec.num_layers)]
    layer = max(layers, key=lambda t: (t.packed, t.elements))
    embedding = _linear(spec, "model.embed_tokens", vocab, hidden, dense)
    output = embedding if spec.tie_word_embeddings else _linear(spec, "lm_head", vocab, hidden, dense)
    return ModelFacts(
        num_layers=spec.num_layers, layer=layer, embedding=embedding,
        head=output + TensorBytes(0, hidden),  # the final norm
        kv_elements_per_token=2 * kv_heads * head_dim, tied_embeddings=spec.tie_word_embeddings,
    )
