"""Tiny random-weight checkpoints of every architecture the suite serves, in mlx-community's file layout.

``TINY_CONFIGS[name]`` is a Hugging Face ``config.json`` small enough for CPU tests (hidden 64, 4-6 layers,
a few experts) that still exercises what makes the architecture itself: routed and shared experts with dense
first layers, MLA's latent cache, sliding-window layers beside global ones, attention sinks, linear-attention
layers. ``tiny_checkpoint(name, root)`` writes it once per directory with mlx-lm's own initialisation
(``stagemesh.bench.random_checkpoint``) and the default model's tokenizer; the vocabulary is the
tokenizer's, so a served model decodes every id it samples.
"""

from __future__ import annotations

from pathlib import Path

VOCAB = 49152  # the default model's tokenizer (SmolLM2)

_COMMON = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "rms_norm_eps": 1e-5, "vocab_size": VOCAB, "max_position_embeddings": 512, "rope_theta": 10000.0}

TINY_CONFIGS: dict[str, dict] = {
    "llama": {**_COMMON, "model_type": "llama", "num_hidden_layers": 4, "intermediate_size": 128,
              "tie_word_embeddings": True},
    "qwen2": {**_COMMON, "model_type": "qwen2", "num_hidden_layers": 4, "intermediate_size": 128,
              "tie_word_embeddings": False},
    "qwen3": {**_COMMON, "model_type": "qwen3", "num_hidden_layers": 4, "intermediate_size": 128,
              "tie_word_embeddings": True},
    "qwen3_moe": {**_COMMON, "model_type": "qwen3_moe", "num_hidden_layers": 4, "intermediate_size": 128,
                  "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
                  "decoder_sparse_step": 1, "mlp_only_layers": [0], "norm_topk_prob": True,
                  "tie_word_embeddings": False},
    "qwen2_moe": {**_COMMON, "model_type": "qwen2_moe", "num_hidden_layers": 4, "intermediate_size": 128,
                  "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64, "num_experts": 8,
                  "num_experts_per_tok": 2, "head_dim": 16, "tie_word_embeddings": False},
    "mixtral": {**_COMMON, "model_type": "mixtral", "num_hidden_layers": 4, "intermediate_size": 64,
                "num_local_experts": 4, "num_experts_per_tok": 2, "tie_word_embeddings": False},
    "gpt_oss": {**_COMMON, "model_type": "gpt_oss", "num_hidden_layers": 4, "intermediate_size": 64,
                "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8,
                "layer_types": ["sliding_attention", "full_attention"] * 2},
    "deepseek_v3": {**_COMMON, "model_type": "deepseek_v3", "num_hidden_layers": 4, "intermediate_size": 128,
                    "moe_intermediate_size": 32, "n_routed_experts": 8, "n_shared_experts": 1,
                    "num_experts_per_tok": 2, "first_k_dense_replace": 1, "moe_layer_freq": 1,
                    "kv_lora_rank": 32, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 32,
                    "v_head_dim": 32, "num_key_value_heads": 4, "n_group": 2, "topk_group": 1,
                    "routed_scaling_factor": 2.5, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
                    "norm_topk_prob": True},
    "glm4_moe": {**_COMMON, "model_type": "glm4_moe", "num_hidden_layers": 4, "intermediate_size": 128,
                 "moe_intermediate_size": 32, "n_routed_experts": 8, "n_shared_experts": 1,
                 "num_experts_per_tok": 2, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
                 "routed_scaling_factor": 1.0, "norm_topk_prob": True, "use_qk_norm": True,
                 "attention_bias": True, "partial_rotary_factor": 0.5, "rope_scaling": None,
                 "tie_word_embeddings": False},
    "gemma3_text": {**_COMMON, "model_type": "gemma3_text", "num_hidden_layers": 6, "intermediate_size": 128,
                    "sliding_window": 8, "sliding_window_pattern": 3, "query_pre_attn_scalar": 16,
                    "rope_local_base_freq": 10000.0},
    "phi3": {**_COMMON, "model_type": "phi3", "num_hidden_layers": 4, "intermediate_size": 128,
             "tie_word_embeddings": False},
    "qwen3_next": {**_COMMON, "model_type": "qwen3_next", "num_hidden_layers": 4, "intermediate_size": 128,
                   "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
                   "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "num_experts": 8,
                   "num_experts_per_tok": 2, "decoder_sparse_step": 1, "shared_expert_intermediate_size": 32,
                   "mlp_only_layers": [], "moe_intermediate_size": 32, "partial_rotary_factor": 0.25,
                   "full_attention_interval": 2, "tie_word_embeddings": False},
    "olmoe": {**_COMMON, "model_type": "olmoe", "num_hidden_layers": 4, "intermediate_size": 32,
              "num_experts": 8, "num_experts_per_tok": 2, "tie_word_embeddings": False},
    "llama4_text": {**_COMMON, "model_type": "llama4_text", "num_hidden_layers": 4, "intermediate_size": 32,
                    "intermediate_size_mlp": 128, "no_rope_layers": [1, 1, 1, 0], "use_qk_norm": True,
                    "tie_word_embeddings": False},
}


def tiny_checkpoint(name: str, root: Path, dtype: str = "float32", quantization: str | None = None) -> str:
    """``TINY_CONFIGS[name]`` written under ``root/name`` (once): config.json, model.safetensors, tokenizer;
    with ``quantization`` (``random_checkpoint.SHAPE_QUANTIZATIONS``) quantized by mlx-lm's own code, under
    ``root/name-quantization``."""
    from stagemesh.bench.random_checkpoint import write_random_checkpoint

    out = root / (name + (f"-{quantization}" if quantization else ""))
    if not (out / "model.safetensors").is_file():
        write_random_checkpoint(TINY_CONFIGS[name], out, dtype=dtype, seed=sum(map(ord, name)),
                                quantization=quantization)
    return str(out)


def mlx_lm_greedy(model, prompts, max_tokens: int) -> list[list[int]]:
    """mlx-lm's own greedy generation (``generate_step``) of each prompt alone on ``model`` (mlx-lm's, loaded)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    outputs = []
    for prompt in prompts:
        steps = generate_step(mx.array(prompt), model, max_tokens=max_tokens,
                              sampler=lambda logits: mx.argmax(logits, axis=-1))
        outputs.append([int(token) for token, _ in steps])
    return outputs


# mlx-lm's stacked expert projections -> Hugging Face's original per-expert names, per architecture:
# (stacked name within a layer, per-expert name within a layer with {e} for the expert).
HF_EXPERTS: dict[str, list[tuple[str, str]]] = {
    "qwen3_moe": [(f"mlp.switch_mlp.{p}.weight", f"mlp.experts.{{e}}.{p}.weight")
                  for p in ("gate_proj", "up_proj", "down_proj")],
    "mixtral": [(f"block_sparse_moe.switch_mlp.{p}.weight", f"block_sparse_moe.experts.{{e}}.{w}.weight")
                for p, w in (("gate_proj", "w1"), ("down_proj", "w2"), ("up_proj", "w3"))],
}


def hf_layout_checkpoint(name: str, root: Path) -> str:
    """``tiny_checkpoint(name)`` rewritten in Hugging Face's original layout: one tensor per expert (the stacked
    ones split), the rest as it is; written under ``root/name-hf`` (once)."""
    import shutil

    import mlx.core as mx

    out = root / f"{name}-hf"
    if (out / "model.safetensors").is_file():
        return str(out)
    source = Path(tiny_checkpoint(name, root))
    shutil.copytree(source, out, dirs_exist_ok=True)
    stacked: dict[str, mx.array] = mx.load(str(source / "model.safetensors"))  # type: ignore[assignment]
    weights = {}
    for key, array in stacked.items():
        split = next(((key[: -len(s)], e) for s, e in HF_EXPERTS[name] if key.endswith(s)), None)
        if split is None:
            weights[key] = array
            continue
        prefix, per_expert = split
        for e in range(array.shape[0]):
            weights[prefix + per_expert.format(e=e)] = array[e]
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    return str(out)
