"""Joined projections (q/k/v as one matmul, gate/up as one) compute what mlx-lm's separate ones do: the real
model, a qwen2 layer with biases, a qwen3 layer with per-head norms, quantized layers, and layers that cannot
be joined, through every shape of batch a stage runs (fresh prompts together, a continued prompt, a decode
group, a lone decode)."""

import mlx.core as mx
import mlx.nn as nn
import pytest

from stage_worker.checkpoint.default_model import default_model_path
from stage_worker.checkpoint.model_reader import read_model_spec
from stage_worker.model.fused_projections import FusedLayer, fusion_wanted
from stage_worker.model.stage_model import StageModel, StageRole
from stagemesh_core.layer_split import LayerRange
from tests.conftest import tiny_config
from tests.joined_outputs import assert_same_outputs, stage_outputs


def _load(path: str, layers: int, dtype: mx.Dtype, load_format: str = "auto") -> StageModel:
    spec = read_model_spec(path, load_format)
    return StageModel.load(spec, StageRole(LayerRange(0, layers), True, False), dtype)


@pytest.mark.e2e
@pytest.mark.parametrize("dense", [True, False], ids=["dequantized", "as-stored-4-bit"])
def test_the_real_model_computes_the_same_with_joined_projections(dense):
    path = str(default_model_path())
    separate, fused = _load(path, 3, mx.float32), _load(path, 3, mx.float32)
    if dense:  # what a CPU or CUDA stage serves
        separate.dequantize()
        fused.dequantize()
    params_before = fused.weight_bytes
    assert fused.fuse_projections() == FusedLayer(qkv=True, gate_up=True)
    assert fused.weight_bytes == params_before  # the same bytes, joined
    attn, mlp = fused.layers[0].self_attn, fused.layers[0].mlp
    assert "qkv_proj" in attn and not {"q_proj", "k_proj", "v_proj"} & set(attn)
    assert "gate_up_proj" in mlp and "gate_proj" not in mlp and "up_proj" not in mlp
    assert isinstance(attn.qkv_proj, nn.QuantizedLinear) is not dense
    assert attn.qkv_proj.weight.shape[0] == 576 + 2 * 192  # SmolLM2-135M: 9 heads, 3 KV heads, all of 64
    assert_same_outputs(stage_outputs(fused), stage_outputs(separate))


QWEN3 = {"head_dim": 16, "rope_theta": 10000.0, "tie_word_embeddings": True}


@pytest.mark.parametrize("model_type,extra", [("qwen2", {}), ("qwen3", QWEN3)])
def test_biases_and_per_head_norms_survive_joining(tmp_path, model_type, extra):
    # qwen2 carries q/k/v biases; qwen3 normalizes queries and keys per head after the projection.
    path = tiny_config(tmp_path / model_type, model_type=model_type, initializer_range=0.05, **extra)
    separate, fused = _load(path, 2, mx.float32, "dummy"), _load(path, 2, mx.float32, "dummy")
    if model_type == "qwen2":
        # Random biases, so a bias joined in the wrong place would show.
        for model in (separate, fused):
            for layer in model.layers:
                for name in ("q_proj", "k_proj", "v_proj"):
                    proj = getattr(layer.self_attn, name)
                    proj.bias = mx.random.normal(proj.bias.shape, key=mx.random.key(len(name) + proj.bias.size))
    assert fused.fuse_projections() == FusedLayer(qkv=True, gate_up=True)
    if model_type == "qwen2":
        assert "bias" in fused.layers[0].self_attn.qkv_proj
    assert_same_outputs(stage_outputs(fused), stage_outputs(separate))


def test_quantized_layers_join_quantized(tmp_path):
    path = tiny_config(tmp_path / "q4", quantization={"group_size": 32, "bits": 4}, tie_word_embeddings=False,
                       initializer_range=0.05)
    separate, fused = _load(path, 2, mx.float32, "dummy"), _load(path, 2, mx.float32, "dummy")
    assert fused.fuse_projections() == FusedLayer(qkv=True, gate_up=True)
    joined = fused.layers[0].self_attn.qkv_proj
    assert isinstance(joined, nn.QuantizedLinear) and (joined.bits, joined.group_size) == (4, 32)
    assert_same_outputs(stage_outputs(fused), stage_outputs(separate))


def test_projections_of_different_kinds_stay_apart(tmp_path):
    path = tiny_config(tmp_path / "mixed", initializer_range=0.05)
    separate, fused = _load(path, 2, mx.float32, "dummy"), _load(path, 2, mx.float32, "dummy")
    for model in (separate, fused):
        # As a mixed-precision checkpoint may store them: q quantized, k and v dense.
        nn.quantize(model.layers[0].self_attn, group_size=32, bits=8,
                    class_predicate=lambda path, _module: path == "q_proj")
    assert fused.fuse_projections() == FusedLayer(qkv=False, gate_up=True)
    first, second = fused.layers[0].self_attn, fused.layers[1].self_attn
    assert {"q_proj", "k_proj", "v_proj"} <= set(first) and "qkv_proj" not in first
    assert "qkv_proj" in second  # the other layer's projections are alike, so they join
    assert_same_outputs(stage_outputs(fused), stage_outputs(separate))


def test_auto_joins_on_gpus_only():
    assert [fusion_wanted("auto", b) for b in ("cpu", "cuda", "metal")] == [False, True, True]
    assert fusion_wanted("on", "cpu") and not fusion_wanted("off", "cuda")
