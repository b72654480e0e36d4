"""GGUF files written from an MLX checkpoint the way llama.cpp's ``convert_hf_to_gguf.py`` writes them.

``convert_checkpoint(mlx_dir, arch, qtype, out)`` writes ``out`` (a ``.gguf``) from a tiny float32 checkpoint
in mlx-community's layout, with llama.cpp's architecture name, metadata keys and tensor names (its own
table here, kept apart from the one stagemesh reads by), its layout (expert stacks as one 3-D tensor per
projection, Qwen2-MoE's shared-expert gate as its one ``[1, hidden]`` row, Gemma's RMSNorm scales stored as
``1 + weight``, 1-D tensors and the routers in F32, every other matrix in ``qtype``) and the embedded default
model's tokenizer metadata (the tiny configs' vocabulary).

Beside ``out`` it writes what mlx-lm's own generation is compared against, MLX checkpoint directories
with the same config and tokenizer: ``reference_dir(out)`` holds the values the GGUF holds as llama.cpp
reads them (``gguf.quants.dequantize``, the norm shift taken back) in float32, and, for a Q8_0 file,
``reference_dir(out, quantized=True)`` the same with the Q8_0 matrices kept quantized, as MLX's own GGUF
reader (``mx.load``) gives them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as Q

# mlx-lm module inside model.layers.N -> llama.cpp tensor base name (gguf-py constants.TENSOR_NAMES).
_COMMON = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
LAYER_NAMES = {
    "qwen3moe": {**_COMMON, "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                 "mlp.gate": "ffn_gate_inp", "mlp.switch_mlp.gate_proj": "ffn_gate_exps",
                 "mlp.switch_mlp.up_proj": "ffn_up_exps", "mlp.switch_mlp.down_proj": "ffn_down_exps"},
    "qwen2moe": {**_COMMON, "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                 "mlp.gate": "ffn_gate_inp", "mlp.switch_mlp.gate_proj": "ffn_gate_exps",
                 "mlp.switch_mlp.up_proj": "ffn_up_exps", "mlp.switch_mlp.down_proj": "ffn_down_exps",
                 "mlp.shared_expert_gate": "ffn_gate_inp_shexp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
                 "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp"},
    "gemma3": {**_COMMON, "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
               "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"},
}
GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
NORM_SHIFT = {"qwen3moe": 0.0, "qwen2moe": 0.0, "gemma3": 1.0}
# llama.cpp keeps the router, and Qwen2-MoE's shared-expert gate (``ffn_gate_inp_shexp``, one row), in F32
# whatever the file type.
KEEP_F32 = ("ffn_gate_inp",)


def gguf_name(arch: str, mlx_name: str) -> str:
    module, kind = mlx_name.rsplit(".", 1)
    if module.startswith("model.layers."):
        index, rest = module[len("model.layers."):].split(".", 1)
        return f"blk.{index}.{LAYER_NAMES[arch][rest]}.{kind}"
    return f"{GLOBAL_NAMES[module]}.{kind}"


def _metadata(writer: gguf.GGUFWriter, arch: str, config: dict) -> None:
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    if arch in ("qwen3moe", "qwen2moe"):
        writer.add_expert_count(config["num_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    if arch == "gemma3":
        writer.add_sliding_window(config["sliding_window"])


def _tokenizer(writer: gguf.GGUFWriter) -> None:
    from stage_worker.checkpoint.default_model import default_model_path
    from stage_worker.checkpoint.gguf.format import read_gguf_header

    md = read_gguf_header(default_model_path()).metadata
    writer.add_tokenizer_model(md["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(md["tokenizer.ggml.pre"])
    writer.add_token_list(md["tokenizer.ggml.tokens"])
    writer.add_token_types(md["tokenizer.ggml.token_type"])
    writer.add_token_merges(md["tokenizer.ggml.merges"])
    writer.add_bos_token_id(md["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(md["tokenizer.ggml.eos_token_id"])
    writer.add_add_bos_token(md["tokenizer.ggml.add_bos_token"])
    writer.add_chat_template(md["tokenizer.chat_template"])


def _stored(arch: str, name: str, w: np.ndarray, qtype: Q) -> tuple[np.ndarray, Q, np.ndarray]:
    """(what the GGUF stores, its type, the float32 values llama.cpp computes with, the norm shift undone)."""
    if w.ndim == 1:
        shift = NORM_SHIFT[arch] if name.endswith("norm.weight") else 0.0
        stored = (w + np.float32(shift)).astype(np.float32)  # the converter's data_torch + 1
        return stored, Q.F32, stored - np.float32(shift)
    if qtype == Q.F32 or any(k in gguf_name(arch, name) for k in KEEP_F32):
        return w, Q.F32, w
    if qtype == Q.F16:
        stored = w.astype(np.float16)
        return stored, Q.F16, stored.astype(np.float32)
    stored = gguf.quants.quantize(w, qtype)
    return stored, qtype, gguf.quants.dequantize(stored, qtype).reshape(w.shape)


def reference_dir(out: Path, quantized: bool = False) -> Path:
    return out.with_suffix(".mlx-quantized" if quantized else ".mlx")


def convert_checkpoint(mlx_dir: str | Path, arch: str, qtype: Q, out: Path, *, seed: int = 0) -> None:
    """Write ``out`` from ``mlx_dir`` as llama.cpp would, and its reference MLX checkpoints (module docstring)."""
    mlx_dir = Path(mlx_dir)
    config = json.loads((mlx_dir / "config.json").read_text())
    source: dict[str, mx.array] = mx.load(str(mlx_dir / "model.safetensors"))  # type: ignore[assignment]
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(out), arch)
    _metadata(writer, arch, config)
    _tokenizer(writer)
    reference: dict[str, np.ndarray] = {}
    quantized: set[str] = set()
    for name in sorted(source):
        if arch == "gemma3" and name == "lm_head.weight":
            continue  # Gemma 3 ties its head to the embedding: its checkpoints hold no lm_head
        w = np.array(source[name].astype(mx.float32))
        if name.endswith("norm.weight"):
            # mlx-lm initialises norms to one value; random ones show a norm read wrongly. Multiples of 2^-10
            # near 1 keep ``shift + w`` exact in float32, as bfloat16 weights would.
            w = (np.round(rng.normal(0, 0.2, w.shape) * 1024) / 1024 + (0.0 if arch == "gemma3" else 1.0))
            w = w.astype(np.float32)
        stored, stored_type, values = _stored(arch, name, w, qtype)
        writer.add_tensor(gguf_name(arch, name), stored, raw_dtype=None if stored_type in (Q.F32, Q.F16) else
                          stored_type)
        reference[name] = values
        if stored_type == Q.Q8_0:
            quantized.add(name)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    arrays = {name: mx.array(values) for name, values in reference.items()}
    _write_reference(mlx_dir, reference_dir(out), config, arrays)
    if quantized:
        loaded: dict[str, mx.array] = mx.load(str(out))  # type: ignore[assignment]
        for name in quantized:
            base = gguf_name(arch, name)[: -len(".weight")]
            module = name[: -len(".weight")]
            arrays[name] = loaded[f"{base}.weight"]
            arrays[f"{module}.scales"] = loaded[f"{base}.scales"]
            arrays[f"{module}.biases"] = loaded[f"{base}.biases"]
        _write_reference(mlx_dir, reference_dir(out, quantized=True),
                         {**config, "quantization": {"group_size": 32, "bits": 8}}, arrays)


def _write_reference(mlx_dir: Path, out: Path, config: dict, arrays: dict[str, mx.array]) -> None:
    shutil.copytree(mlx_dir, out, dirs_exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    mx.save_safetensors(str(out / "model.safetensors"), arrays, metadata={"format": "mlx"})
