"""Sibling projections joined in mlx-lm's own layers compute what the separate ones do.

``stage_worker.model.sibling_projections`` on every architecture the layer-stack path serves (tiny random checkpoints
of the suite), through every shape of batch a stage runs: fresh prompts together, a continued prompt, a decode
group, a lone decode (the one-row case that takes the joined product). Also quantized experts, the all-experts
routing reading the joined experts, groups left apart because their formats differ, and the bytes held.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.switch_layers import QuantizedSwitchLinear

from stage_worker.checkpoint.mlx_arch import STACK_ARCHITECTURES
from stage_worker.checkpoint.model_reader import read_model_spec
from stage_worker.model.expert_routing import ExpertsPolicy, RoutedSwitchGLU
from stage_worker.model.sibling_projections import ProjectionPart, join_sibling_projections, joined_layer
from stage_worker.model.stage_model import StageModel, StageRole
from stagemesh_core.layer_split import LayerRange
from tests.architectures import tiny_checkpoint
from tests.joined_outputs import assert_same_outputs, stage_outputs

# The joined children in the last layer of each tiny model (what its mlx-lm module calls by the parts' names).
# MLA's attention has no q/k/v triple; phi3 and Qwen3-Next's linear attention arrive joined; llama4_text's
# last layer is dense here.
JOINED_IN_LAST_LAYER = {
    "deepseek_v3": {"mlp.shared_experts.gate_up_proj", "mlp.switch_mlp.gate_up_proj"},
    "gemma3_text": {"mlp.gate_up_proj", "self_attn.qkv_proj"},
    "glm4_moe": {"mlp.shared_experts.gate_up_proj", "mlp.switch_mlp.gate_up_proj", "self_attn.qkv_proj"},
    "gpt_oss": {"mlp.experts.gate_up_proj", "self_attn.qkv_proj"},
    "llama4_text": {"feed_forward.gate_up_proj", "self_attn.qkv_proj"},
    "mixtral": {"block_sparse_moe.switch_mlp.gate_up_proj", "self_attn.qkv_proj"},
    "olmoe": {"mlp.switch_mlp.gate_up_proj", "self_attn.qkv_proj"},
    "phi3": set(),
    "qwen2_moe": {"mlp.shared_expert.gate_up_proj", "mlp.switch_mlp.gate_up_proj", "self_attn.qkv_proj"},
    "qwen3_moe": {"mlp.switch_mlp.gate_up_proj", "self_attn.qkv_proj"},
    "qwen3_next": {"mlp.shared_expert.gate_up_proj", "mlp.switch_mlp.gate_up_proj", "self_attn.qkv_proj"},
}


def _whole(path: str) -> StageModel:
    spec = read_model_spec(path, "auto")
    return StageModel.load(spec, StageRole(LayerRange(0, spec.num_layers), True, True), mx.float32)


def _joined_in(layer: nn.Module) -> set[str]:
    """The joined children under ``layer`` whose parts the model's code calls (``ProjectionPart`` siblings)."""
    return {f"{path}.{joined}".lstrip(".") for path, module in layer.named_modules()
            for joined in ("qkv_proj", "gate_up_proj")
            if joined in module and any(isinstance(value, ProjectionPart) for value in module.values())}


@pytest.mark.parametrize("name", STACK_ARCHITECTURES)
def test_every_stack_architecture_computes_the_same_with_joined_siblings(name, tmp_path_factory):
    path = tiny_checkpoint(name, tmp_path_factory.getbasetemp() / "sibling-checkpoints")
    separate, joined = _whole(path), _whole(path)
    held = joined.weight_bytes
    joined.fuse_projections()
    assert joined.weight_bytes == held  # the same bytes, joined
    assert _joined_in(joined.layers[-1]) == JOINED_IN_LAST_LAYER[name]
    assert_same_outputs(stage_outputs(joined), stage_outputs(separate))


@pytest.mark.parametrize("quantization", ["affine4", "mxfp4"])
@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_quantized_experts_and_projections_join_and_compute_the_same(name, quantization, tmp_path_factory):
    path = tiny_checkpoint(name, tmp_path_factory.getbasetemp() / "sibling-checkpoints", quantization=quantization)
    separate, joined = _whole(path), _whole(path)
    assert joined.quantized
    held = joined.weight_bytes
    joined.fuse_projections()
    assert joined.weight_bytes == held
    experts = joined.layers[-1].mlp.experts if name == "gpt_oss" else joined.layers[-1].mlp.switch_mlp
    assert isinstance(experts.gate_up_proj, QuantizedSwitchLinear)  # still quantized, in the parts' format
    assert_same_outputs(stage_outputs(joined), stage_outputs(separate))


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_every_expert_routing_reads_the_joined_experts(name, tmp_path_factory):
    path = tiny_checkpoint(name, tmp_path_factory.getbasetemp() / "sibling-checkpoints")
    separate, joined = _whole(path), _whole(path)
    policy = ExpertsPolicy(all_experts_max_rows=512, all_experts_min_pairs=1)  # every call runs every expert
    joined.fuse_projections()
    assert separate.route_experts(policy) == joined.route_experts(policy) > 0
    block = joined.layers[-1].mlp.experts if name == "gpt_oss" else joined.layers[-1].mlp.switch_mlp
    assert isinstance(block, RoutedSwitchGLU) and "gate_up_proj" in block
    assert_same_outputs(stage_outputs(joined), stage_outputs(separate))


def test_a_mixed_quantization_leaves_apart_the_groups_whose_formats_differ(tmp_path_factory):
    # mlx-lm's mixed_3_6 recipe gives v_proj and down_proj 6 bits in some layers, q/k 3 bits: those stay apart.
    path = tiny_checkpoint("qwen3_moe", tmp_path_factory.getbasetemp() / "sibling-checkpoints",
                           quantization="mixed_3_6")
    separate, joined = _whole(path), _whole(path)
    joined.fuse_projections()
    formats = [{layer.self_attn[p].bits for p in ("q_proj", "k_proj", "v_proj")} if "qkv_proj" not in layer.self_attn
               else None for layer in joined.layers]
    assert any(f is not None and len(f) > 1 for f in formats)  # some layers kept apart, by their bits
    assert_same_outputs(stage_outputs(joined), stage_outputs(separate))


def test_parts_of_different_kinds_or_biases_are_not_joined():
    dense, quantized = nn.Linear(64, 32), nn.QuantizedLinear(64, 32)
    assert joined_layer([dense, quantized]) is None
    assert joined_layer([nn.Linear(64, 32, bias=True), nn.Linear(64, 32, bias=False)]) is None
    assert joined_layer([nn.Linear(64, 32), nn.Linear(48, 32)]) is None  # another input width
    assert joined_layer([nn.QuantizedLinear(64, 32, bits=4), nn.QuantizedLinear(64, 32, bits=8)]) is None
    both = joined_layer([nn.Linear(64, 32, bias=True), nn.Linear(64, 16, bias=True)])
    assert both is not None and both.weight.shape == (48, 64) and both.bias.shape == (48,)


def test_a_part_reuses_its_groups_product_only_for_the_same_input():
    mx.random.seed(0)
    module = nn.Module()
    module.q_proj, module.k_proj, module.v_proj = nn.Linear(16, 8), nn.Linear(16, 4), nn.Linear(16, 4)
    separate = {n: module[n] for n in ("q_proj", "k_proj", "v_proj")}
    assert join_sibling_projections(module).qkv == 1
    one, other = mx.random.normal((1, 1, 16)), mx.random.normal((1, 1, 16))
    # Interleaved inputs: a part given another array than its siblings computes for that array.
    for x, name in [(one, "q_proj"), (other, "k_proj"), (one, "v_proj"), (other, "q_proj")]:
        assert mx.array_equal(module[name](x), separate[name](x)).item(), name
    rows = mx.random.normal((3, 5, 16))  # more rows: each part multiplies by its own rows of the joined weight
    for name, linear in separate.items():
        assert mx.allclose(module[name](rows), linear(rows), rtol=1e-5, atol=1e-5).item()
