"""llama.cpp's GGUF architectures as mlx-lm models: one table per architecture.

Contract:
* ``gguf_architecture(name)`` is the ``GGUFArchitecture`` of a GGUF's ``general.architecture`` (every name in
  ``model_spec.GGUF_ARCHITECTURES``), or ``ModelFormatError`` naming it and the supported ones.
* ``GGUFArchitecture.mlx_name(gguf_name)`` is the mlx-lm parameter name of a GGUF tensor, None for a tensor the
  architecture's mlx-lm model has no counterpart of; tensor shapes need no change.
* ``GGUFArchitecture.model_args(md, facts)`` is the ``ModelArgs`` dict of the architecture's mlx-lm model from
  the GGUF metadata and the facts every architecture shares (``CommonFacts``), pure: a file means what it means
  to llama.cpp, and what mlx-lm's model cannot express is refused.
* ``permuted_qk`` and ``norm_shift`` name the converter's quirks a loader undoes (``gguf_format``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from stage_worker.checkpoint.model_spec import GGUF_ARCHITECTURES, ModelFormatError

# ``blk.N.<base>.weight|bias``: a decoder layer's tensor; ``<base>.weight|bias``: a tensor outside the layers.
BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
GLOBAL_RE = re.compile(r"^([a-z_]+)\.(weight|bias)$")

GLOBAL_TENSORS: Mapping[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

# Per-layer GGUF base names (llama.cpp's gguf-py ``constants.TENSOR_NAMES``) -> mlx-lm modules in model.layers.N.
_ATTENTION: Mapping[str, str] = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
}
_QK_NORM: Mapping[str, str] = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_DENSE_MLP: Mapping[str, str] = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_PRE_NORMS: Mapping[str, str] = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_EXPERTS: Mapping[str, str] = {
    "ffn_gate_inp": "mlp.gate",  # the router
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
}
# Qwen2-MoE's shared expert, beside the routed ones, scaled by its own sigmoid gate (one weight row).
_SHARED_EXPERT: Mapping[str, str] = {
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# Gemma 3 normalizes before and after both attention and MLP; llama.cpp's ``ffn_norm`` is the pre-MLP one.
_GEMMA3_NORMS: Mapping[str, str] = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


@dataclass(frozen=True)
class CommonFacts:
    """What ``gguf_format`` reads for every architecture before the architecture's own arguments."""

    num_layers: int
    hidden_size: int
    num_heads: int
    head_dim: int
    context_length: int
    rope_scaling: Mapping[str, Any] | None
    tensor_names: frozenset[str]


Metadata = Callable[..., Any]  # md(key) or md(key, default): ``{arch}.{key}`` of the GGUF metadata


@dataclass(frozen=True)
class GGUFArchitecture:
    """How one llama.cpp architecture maps onto one mlx-lm model.

    The converter's quirks to undo on load: ``permuted_qk`` (llama.cpp permutes llama's q/k rows for its
    interleaved rotary layout) and ``norm_shift`` (``convert_hf_to_gguf.py`` stores each Gemma 3 RMSNorm scale
    as ``1 + weight``, the factor Gemma applies; mlx-lm's Gemma 3 norms add the 1 themselves).
    """

    name: str  # general.architecture
    model_type: str  # the mlx_lm.models module
    hf_architecture: str
    layer_tensors: Mapping[str, str]
    default_rope_theta: float
    args: Callable[[Metadata, CommonFacts], dict[str, Any]]
    permuted_qk: bool = False
    norm_shift: float = 0.0

    def mlx_name(self, name: str) -> str | None:
        """GGUF tensor name -> mlx-lm parameter name (None: not a parameter of this architecture's model), e.g.
        ``blk.3.ffn_up_exps.weight`` -> ``model.layers.3.mlp.switch_mlp.up_proj.weight``. Tensor shapes need
        no change: llama.cpp stacks a layer's experts as mlx-lm does, ``(experts, out, in)``."""
        if m := BLOCK_RE.match(name):
            module = self.layer_tensors.get(m.group(2))
            return None if module is None else f"model.layers.{m.group(1)}.{module}.{m.group(3)}"
        if m := GLOBAL_RE.match(name):
            module = GLOBAL_TENSORS.get(m.group(1))
            return None if module is None else f"{module}.{m.group(2)}"
        return None

    def model_args(self, md: Metadata, facts: CommonFacts) -> dict[str, Any]:
        """The mlx-lm ``ModelArgs`` entries of this architecture beyond the common ones (pure); ``md(key,
        default)`` reads ``{arch}.{key}``. What llama.cpp's loader fixes in code rather than reading from the
        file is fixed the same way here (Gemma 3: one global layer in six, local rope base 10000, the attention
        scale of the 27B); what mlx-lm's model cannot express (a final logit soft-cap, rope scaling mlx-lm's
        Qwen3-MoE ignores) raises ``ModelFormatError``."""
        return self.args(md, facts)


def _no_extra_args(md: Metadata, facts: CommonFacts) -> dict[str, Any]:
    return {}


def _qwen2_args(md: Metadata, facts: CommonFacts) -> dict[str, Any]:
    if facts.head_dim != facts.hidden_size // facts.num_heads:
        raise ModelFormatError("qwen2 GGUF with head_dim != hidden/heads is not supported by mlx-lm's qwen2 model.")
    return {}


def _refuse_rope_scaling(facts: CommonFacts, architecture: str, mlx_model: str) -> None:
    """A GGUF of ``architecture`` whose rotary embeddings are scaled: mlx-lm's ``mlx_model`` does not apply it."""
    if facts.rope_scaling is not None:
        raise ModelFormatError(
            f"this {architecture} GGUF scales its rotary embeddings ({dict(facts.rope_scaling)}), which mlx-lm's "
            f"{mlx_model} model does not apply; use a file converted without rope scaling (the model's native "
            "context) or an MLX model directory."
        )


def _qwen3moe_args(md: Metadata, facts: CommonFacts) -> dict[str, Any]:
    _refuse_rope_scaling(facts, "qwen3moe", "qwen3_moe")
    experts = int(md("expert_count"))
    expert_ffn = int(md("expert_feed_forward_length"))
    # llama.cpp routes every layer through experts; a layer holding a dense MLP instead is mlx-lm's mlp_only_layers.
    dense = [i for i in range(facts.num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in facts.tensor_names]
    return {
        "num_experts": experts,
        "num_experts_per_tok": int(md("expert_used_count")),
        "moe_intermediate_size": expert_ffn,
        "intermediate_size": int(md("feed_forward_length", expert_ffn)),
        "decoder_sparse_step": 1,
        "mlp_only_layers": dense,
        # llama.cpp's qwen3moe graph always renormalizes the chosen experts' weights (as Qwen3 MoE's configs ask).
        "norm_topk_prob": True,
    }


def _qwen2moe_args(md: Metadata, facts: CommonFacts) -> dict[str, Any]:
    _qwen2_args(md, facts)  # the same attention: head_dim is hidden/heads in mlx-lm's qwen2_moe model
    _refuse_rope_scaling(facts, "qwen2moe", "qwen2_moe")
    experts = int(md("expert_count"))
    expert_ffn = int(md("expert_feed_forward_length"))
    # Every qwen2moe layer is routed and holds the shared expert (llama.cpp's loader requires both), and its graph
    # weighs the chosen experts by their softmax scores as they are (no renormalizing), as mlx-lm's model does.
    return {
        "num_experts": experts,
        "num_experts_per_tok": int(md("expert_used_count")),
        "moe_intermediate_size": expert_ffn,
        "shared_expert_intermediate_size": int(md("expert_shared_feed_forward_length")),
        "intermediate_size": int(md("feed_forward_length", expert_ffn)),
    }


# llama.cpp's Gemma 3 loader fixes these in code: one global-attention layer in six, the others sliding with
# rotary base 10000 and no rope scaling (hparams.set_swa_pattern(6), rope_freq_base_train_swa).
GEMMA3_SLIDING_WINDOW_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10_000.0
GEMMA3_27B_LAYERS = 62  # llama.cpp scales the 27B's attention by hidden/heads, the others' by head_dim


def _gemma3_args(md: Metadata, facts: CommonFacts) -> dict[str, Any]:
    softcap = md("final_logit_softcapping", None)
    if softcap:
        raise ModelFormatError(
            f"this gemma3 GGUF soft-caps its final logits at {softcap}, which mlx-lm's gemma3_text model does "
            "not do; use an MLX model directory for this model."
        )
    value_length = int(md("attention.value_length", facts.head_dim))
    if value_length != facts.head_dim:
        raise ModelFormatError(f"gemma3 GGUF with value length {value_length} != key length {facts.head_dim} is "
                               "not supported by mlx-lm's gemma3_text model.")
    window = int(md("attention.sliding_window", 0) or 0)
    scalar = (facts.hidden_size // facts.num_heads if facts.num_layers == GEMMA3_27B_LAYERS else facts.head_dim)
    return {
        # Without a window llama.cpp attends globally in every layer: a pattern of 1 does so in mlx-lm.
        "sliding_window": window or facts.context_length,
        "sliding_window_pattern": GEMMA3_SLIDING_WINDOW_PATTERN if window else 1,
        "rope_local_base_freq": GEMMA3_LOCAL_ROPE_BASE,
        "query_pre_attn_scalar": scalar,
    }


ARCHITECTURES: Mapping[str, GGUFArchitecture] = {
    arch.name: arch
    for arch in (
        GGUFArchitecture("llama", "llama", "LlamaForCausalLM", {**_PRE_NORMS, **_ATTENTION, **_DENSE_MLP},
                         10_000.0, _no_extra_args, permuted_qk=True),
        GGUFArchitecture("qwen2", "qwen2", "Qwen2ForCausalLM", {**_PRE_NORMS, **_ATTENTION, **_DENSE_MLP},
                         1_000_000.0, _qwen2_args),
        GGUFArchitecture("qwen3", "qwen3", "Qwen3ForCausalLM",
                         {**_PRE_NORMS, **_ATTENTION, **_QK_NORM, **_DENSE_MLP}, 1_000_000.0, _no_extra_args),
        GGUFArchitecture("qwen3moe", "qwen3_moe", "Qwen3MoeForCausalLM",
                         {**_PRE_NORMS, **_ATTENTION, **_QK_NORM, **_DENSE_MLP, **_EXPERTS}, 1_000_000.0,
                         _qwen3moe_args),
        GGUFArchitecture("qwen2moe", "qwen2_moe", "Qwen2MoeForCausalLM",
                         {**_PRE_NORMS, **_ATTENTION, **_EXPERTS, **_SHARED_EXPERT}, 1_000_000.0, _qwen2moe_args),
        GGUFArchitecture("gemma3", "gemma3_text", "Gemma3ForCausalLM",
                         {**_GEMMA3_NORMS, **_ATTENTION, **_QK_NORM, **_DENSE_MLP}, 1_000_000.0, _gemma3_args,
                         norm_shift=1.0),
    )
}
assert tuple(ARCHITECTURES) == GGUF_ARCHITECTURES, "model_spec.GGUF_ARCHITECTURES lists the tables here"


def gguf_architecture(name: Any) -> GGUFArchitecture:
    """The table of a GGUF's ``general.architecture``; ``ModelFormatError`` for one stagemesh does not serve."""
    if name not in ARCHITECTURES:
        raise ModelFormatError(
            f"GGUF architecture {name!r} is not supported; stagemesh serves "
            f"{', '.join(GGUF_ARCHITECTURES)} GGUFs (llama covers SmolLM2, Llama 3.x and Mistral; qwen2moe "
            "Qwen1.5-MoE and Qwen2-57B-A14B; gemma3 the text layers of Gemma 3). Use a model of one of these "
            "architectures, or an MLX model directory."
        )
    return ARCHITECTURES[name]
