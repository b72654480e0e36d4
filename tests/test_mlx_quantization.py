"""Every MLX quantization mode, written by mlx-lm's own code, served at PP=2 equals mlx-lm on the same files.

Each case is a tiny random checkpoint (``tests/architectures.py``) quantized as mlx_lm.convert quantizes:
affine at 1 to 8 bits through mixed recipes (per-module overrides in config.json) and plain widths, mxfp4, nvfp4
and mxfp8, a mixture of experts in mxfp4, and gpt-oss as mlx-community ships it (its experts mxfp4, the rest
affine 8-bit: overrides whose mode differs from the top level's). For each, two stages loaded by the real
stage code, kept quantized (``--dequantize off``), run a real in-process pipeline whose greedy tokens must equal
mlx-lm's ``generate_step`` on ``mlx_lm.utils.load_model`` of the same directory, token for token; the planner's
facts must equal the bytes each stage holds; dequantized (``--dequantize on``), the stages must equal mlx-lm's
model dequantized by ``mlx_lm.utils.dequantize_model``. gpt-oss as openai publishes it (``quant_method: mxfp4``,
experts in blocks that mlx-lm's ``sanitize`` lays out) serves as mlx-lm reads it. What MLX cannot serve is refused
at spec time.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

from stage_worker.checkpoint.checkpoint_check import check_checkpoint
from stage_worker.checkpoint.model_reader import read_model_spec
from stage_worker.checkpoint.model_spec import QUANT_MODES, ModelFormatError, QuantParams
from stage_worker.model.model_facts import model_facts
from stage_worker.model.stage_model import StageModel, StageRole
from stagemesh.bench.random_checkpoint import SHAPE_QUANTIZATIONS
from stagemesh_core.layer_split import LayerRange, even_split
from tests.architectures import TINY_CONFIGS, mlx_lm_greedy, tiny_checkpoint
from tests.engine_helpers import InProcessPipeline, read_until_finished

PROMPTS = ((504, 35, 282, 46, 314, 108, 28, 227, 253, 11, 12), (17, 42, 99))
MAX_TOKENS = 5
SMALL_VOCAB = 512  # the cases written without a tokenizer: quicker to draw and quantize
GPT_OSS_AS_PUBLISHED = "gpt_oss-mxfp4-experts"
MXFP4 = {"group_size": 32, "bits": 4, "mode": "mxfp4"}
# A mode per layer of the tiny qwen3 (4 layers; the last one's down_proj affine 1-bit), its embedding and head
# affine 8-bit.
EVERY_MODE = {0: MXFP4, 1: {"group_size": 16, "bits": 4, "mode": "nvfp4"},
              2: {"group_size": 32, "bits": 8, "mode": "mxfp8"}, 3: {"group_size": 32, "bits": 5, "mode": "affine"}}
ONE_BIT = {"group_size": 64, "bits": 1, "mode": "affine"}


def _every_mode(model: nn.Module):
    def predicate(path: str, module: nn.Module) -> dict | bool:
        parts = path.split(".")
        if parts[1] != "layers":
            return True
        return dict(ONE_BIT if path == "model.layers.3.mlp.down_proj" else EVERY_MODE[int(parts[2])])

    return predicate


def _mixed_3_4(model: nn.Module):
    from mlx_lm.convert import mixed_quant_predicate_builder

    return mixed_quant_predicate_builder("mixed_3_4", model, 64)


def _gpt_oss_as_published(model: nn.Module):
    return lambda path, module: dict(MXFP4) if ".experts." in path else True


# case: how it is quantized. Together: affine 1, 2, 3, 4, 5, 6 and 8 bits (mixed recipes' per-module overrides),
# mxfp4, nvfp4 and mxfp8 (as the top-level mode and as overrides), experts (SwitchLinear) in mxfp4.
# The first goes through the bench's --shape-quantization (SHAPE_QUANTIZATIONS); the others through
# mlx_lm.utils.quantize_model as mlx_lm.convert calls it: (architecture, q_mode, q_bits, q_group_size, a builder
# of the quant_predicate from the model, or None).
CASES = {
    "llama-mixed_2_6": "mixed_2_6",
    "qwen2-mixed_3_4": ("qwen2", "affine", None, 64, _mixed_3_4),
    "qwen3-every-mode": ("qwen3", "affine", 8, 64, _every_mode),
    "qwen3_moe-mxfp4": ("qwen3_moe", "mxfp4", None, None, None),
    # as mlx-community ships gpt-oss: experts mxfp4 (their own mode in config.json), the rest affine 8-bit
    GPT_OSS_AS_PUBLISHED: ("gpt_oss", "affine", 8, 64, _gpt_oss_as_published),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlx-quantization")

    def made(case: str) -> str:
        how = CASES[case]
        if isinstance(how, str):
            return tiny_checkpoint(case.split("-")[0], root, quantization=how)
        return _quantized_by_mlx_lm(root / case, *how)

    return made


def _experts_only(model: nn.Module):
    return lambda path, module: dict(MXFP4) if ".experts." in path else False


def _openai_gpt_oss_layout(root: Path) -> str:
    """gpt-oss as openai publishes it (``quant_method: mxfp4``): each layer's experts as
    ``gate_up_proj_blocks`` (gate and up rows interleaved, the codes as bytes of 16 per group), ``_scales`` and
    ``_bias``, the rest dense; made from mlx-lm's own mxfp4 quantization of the experts, so mlx-lm's gpt_oss
    ``sanitize`` must give back exactly those tensors."""
    out = root / "gpt_oss-openai"
    if out.is_dir():
        return str(out)
    source = Path(_quantized_by_mlx_lm(root / "gpt_oss-experts-only", "gpt_oss", "mxfp4", None, None, _experts_only))
    stacked: dict[str, mx.array] = mx.load(str(source / "model.safetensors"))  # type: ignore[assignment]

    def interleaved(gate: mx.array, up: mx.array, axis: int) -> mx.array:
        return mx.stack([gate, up], axis=axis + 1).reshape(*gate.shape[:axis], -1, *gate.shape[axis + 1:])

    def blocks(codes: mx.array) -> mx.array:  # [..., rows, in * 4 / 32] uint32 -> [..., rows, groups, 16] uint8
        return codes.view(mx.uint8).reshape(*codes.shape[:-1], -1, 16)

    weights = {}
    for name, array in stacked.items():
        prefix, _, rest = name.partition(".mlp.experts.")
        if not rest:
            weights[name] = array
        elif rest == "down_proj.weight":
            weights[f"{prefix}.mlp.experts.down_proj_blocks"] = blocks(array)
        elif rest in ("down_proj.scales", "down_proj.bias"):
            weights[f"{prefix}.mlp.experts.down_proj_{rest.split('.')[1]}"] = array
        elif rest.startswith("gate_proj."):
            kind = rest.split(".")[1]
            up = stacked[f"{prefix}.mlp.experts.up_proj.{kind}"]
            joined = interleaved(array, up, array.ndim - (1 if kind == "bias" else 2))
            suffix = {"weight": "blocks", "scales": "scales", "bias": "bias"}[kind]
            weights[f"{prefix}.mlp.experts.gate_up_proj_{suffix}"] = blocks(joined) if kind == "weight" else joined
    out.mkdir()
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    config = json.loads((source / "config.json").read_text())
    del config["quantization"]
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


def test_openai_gpt_oss_in_mxfp4_blocks_equals_mlx_lm(tmp_path_factory):
    from mlx_lm.utils import load_model

    root = tmp_path_factory.mktemp("gpt-oss-openai")
    path = _openai_gpt_oss_layout(root)
    spec = read_model_spec(path)
    check_checkpoint(spec)
    assert spec.quantization_for("model.layers.2.mlp.experts.down_proj") == QuantParams(32, 4, "mxfp4")
    assert spec.quantization_for("model.layers.2.self_attn.q_proj") is None
    stages = _stages(spec)
    assert stages[1].layers[0].mlp.experts.up_proj.mode == "mxfp4"
    _assert_facts_equal_the_stages(spec, stages, dense=False)
    served = _served(stages)
    assert served == mlx_lm_greedy(load_model(Path(path))[0], PROMPTS, MAX_TOKENS)
    # The layout round-trips: the same tokens as mlx-lm's own mxfp4 files it was made from.
    assert served == mlx_lm_greedy(load_model(root / "gpt_oss-experts-only")[0], PROMPTS, MAX_TOKENS)


def _quantized_by_mlx_lm(out: Path, name: str, mode: str, bits, group_size, predicate_of) -> str:
    """A tiny random model quantized and saved by mlx-lm's own code (``quantize_model``, ``save_model``,
    ``save_config``), without a tokenizer (token ids in, token ids out)."""
    from mlx_lm.utils import _get_classes, quantize_model, save_config, save_model

    if not out.is_dir():
        config = {**TINY_CONFIGS[name], "vocab_size": SMALL_VOCAB}
        model_class, args_class = _get_classes(config)
        mx.random.seed(sum(map(ord, name)))
        model = model_class(args_class.from_dict(config))
        model, config = quantize_model(model, config, group_size, bits, mode=mode,
                                       quant_predicate=predicate_of(model) if predicate_of else None)
        save_model(out, model)
        save_config(config, out / "config.json")
    return str(out)


def _stages(spec) -> list[StageModel]:
    ranges = even_split(spec.num_layers, 2)
    return [StageModel.load(spec, StageRole(LayerRange(r.start, r.end), i == 0, i == 1), mx.float32)
            for i, r in enumerate(ranges)]


def _served(stages: list[StageModel]) -> list[list[int]]:
    with InProcessPipeline(stages) as pipeline:
        outputs, _ = read_until_finished([pipeline.submit(p, MAX_TOKENS) for p in PROMPTS])
    return outputs


def _assert_facts_equal_the_stages(spec, stages: list[StageModel], dense: bool) -> None:
    facts = model_facts(spec, dense=dense)
    for stage in stages:
        role = stage.role
        assert facts.slice_weight_bytes(role.layers.start, role.layers.end, first=role.is_first,
                                        last=role.is_last, element_bytes=4) == stage.weight_bytes, role


@pytest.mark.parametrize("case", CASES)
def test_quantized_pipeline_equals_mlx_lm_and_the_planner(checkpoints, case):
    from mlx_lm.utils import load_model

    path = checkpoints(case)
    spec = read_model_spec(path)
    check_checkpoint(spec)
    reference = mlx_lm_greedy(load_model(Path(path))[0], PROMPTS, MAX_TOKENS)
    stages = _stages(spec)
    assert all(stage.quantized for stage in stages)
    _assert_facts_equal_the_stages(spec, stages, dense=False)
    assert _served(stages) == reference
    if case == "qwen3-every-mode":
        held = [(layer.mlp.up_proj.mode, layer.mlp.up_proj.bits, layer.mlp.down_proj.bits)
                for stage in stages for layer in stage.layers]
        assert held == [("mxfp4", 4, 4), ("nvfp4", 4, 4), ("mxfp8", 8, 8), ("affine", 5, 1)]
    if case == GPT_OSS_AS_PUBLISHED:
        experts = spec.quantization_for("model.layers.1.mlp.experts.gate_proj")
        assert experts == QuantParams(32, 4, "mxfp4")
        assert spec.quantization_for("model.layers.1.self_attn.q_proj") == QuantParams(64, 8, "affine")
        assert stages[1].layers[0].mlp.experts.gate_proj.mode == "mxfp4"


@pytest.mark.parametrize("case", ["qwen3-every-mode", "qwen3_moe-mxfp4"])
def test_dequantized_pipeline_equals_mlx_lm_dequantized(checkpoints, case):
    from mlx_lm.utils import dequantize_model, load_model

    path = checkpoints(case)
    spec = read_model_spec(path)
    model = load_model(Path(path))[0]
    reference = mlx_lm_greedy(dequantize_model(model), PROMPTS, MAX_TOKENS)
    stages = _stages(spec)
    dense_bytes = [stage.dense_bytes() for stage in stages]
    for stage in stages:
        stage.dequantize()
    assert not any(stage.quantized for stage in stages)
    assert [stage.weight_bytes for stage in stages] == dense_bytes
    _assert_facts_equal_the_stages(spec, stages, dense=True)
    assert _served(stages) == reference


def test_mixed_recipe_layers_are_counted_each_at_its_own_size(checkpoints):
    spec = read_model_spec(checkpoints("llama-mixed_2_6"))
    facts = model_facts(spec)
    # mlx_lm's mixed_2_6 keeps v_proj and down_proj at 6 bits in the last layers (of 4: 2 and 3), 2 bits elsewhere.
    assert facts.layer_sizes and facts.layer_sizes[0] == facts.layer_sizes[1] != facts.layer_sizes[3]
    assert facts.layer == max(facts.layer_sizes, key=lambda t: t.packed)


def test_shape_quantizations_are_mlx_lms():
    from mlx_lm.convert import QUANT_RECIPES

    assert {q.recipe for q in SHAPE_QUANTIZATIONS.values() if q.recipe} == set(QUANT_RECIPES)
    assert {q.mode for q in SHAPE_QUANTIZATIONS.values()} == set(QUANT_MODES)


def test_bench_compare_takes_a_shape_quantization(tmp_path):
    import argparse

    from stagemesh.bench import compare
    from stagemesh.bench.random_checkpoint import check_shape_flags, shape_description

    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    args = parser.parse_args(["--shape", "llama-3.1-8b", "--shape-layers", "8", "--shape-quantization", "mxfp4"])
    check_shape_flags(args)
    assert (args.shape_quantization, shape_description(args)) == ("mxfp4", "random bfloat16, mxfp4")
    with pytest.raises(SystemExit):
        parser.parse_args(["--shape", "llama-3.1-8b", "--shape-quantization", "q4_k_m"])


def test_served_modes_are_what_mx_quantize_takes():
    weight = mx.zeros((8, 128))
    for mode in QUANT_MODES:
        for group_size in (16, 32, 64, 128):
            for bits in range(1, 9):
                try:
                    mx.eval(mx.quantize(weight, group_size, bits, mode=mode))
                    takes = True
                except ValueError:
                    takes = False
                served = bits in QUANT_MODES[mode][0] and group_size in QUANT_MODES[mode][1]
                assert served == takes, (mode, group_size, bits)


def _with_quantization(source: str, tmp_path: Path, quantization: dict, **extra) -> str:
    """``source``'s files with config.json's quantization replaced."""
    import shutil

    out = tmp_path / "edited"
    shutil.copytree(source, out)
    config = json.loads((out / "config.json").read_text())
    config.update(quantization=quantization, quantization_config=quantization, **extra)
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


@pytest.mark.parametrize("quantization,extra,message", [
    ({"group_size": 64, "bits": 4, "mode": "mxfp4"}, {}, "mxfp4 4-bit, group size 64"),
    ({"group_size": 32, "bits": 4, "mode": "fp3"}, {}, "quantization mode 'fp3'"),
    ({"group_size": 64, "bits": 4, "model.layers.1.mlp.down_proj": {"group_size": 32, "bits": 8, "mode": "nvfp4"}},
     {}, "module model.layers.1.mlp.down_proj uses nvfp4 8-bit, group size 32"),
    ({"group_size": 64, "bits": 7}, {}, "affine 7-bit, group size 64"),
    ({"group_size": 16, "bits": 4, "mode": "nvfp4",
      "model.layers.0.mlp.switch_mlp.up_proj": {"group_size": 16, "bits": 4, "mode": "nvfp4", "global_scale": True}},
     {}, "global scale"),
    ({"group_size": 32, "bits": 8, "mode": "mxfp8"}, {"quantize_activations": True}, "quantize_activations"),
])
def test_what_mlx_cannot_serve_is_refused_naming_module_mode_and_what_is_served(checkpoints, tmp_path, quantization,
                                                                              extra, message):
    path = _with_quantization(checkpoints("qwen3_moe-mxfp4"), tmp_path, quantization, **extra)
    with pytest.raises(ModelFormatError, match="(?s)" + message.replace("(", r"\(")) as refused:
        read_model_spec(path)
    if "MLX serves" in str(refused.value):
        assert "mxfp4 with 4 bits in groups of 32" in str(refused.value)
        assert "affine with 1/2/3/4/5/6/8 bits in groups of 32/64/128" in str(refused.value)


def test_scales_of_another_mode_than_the_config_says_are_named(checkpoints, tmp_path):
    # mxfp4 files under a config saying affine 4-bit in groups of 32: the codes and scales have the same shapes.
    path = _with_quantization(checkpoints("qwen3_moe-mxfp4"), tmp_path, {"group_size": 32, "bits": 4})
    with pytest.raises(ModelFormatError, match="model.layers.0.self_attn.q_proj.scales in model.safetensors: its "
                                               r"scales are uint8 \(an mxfp4, nvfp4 or mxfp8 module\) in the files, "
                                               r"floating \(an affine module\) by the config"):
        check_checkpoint(read_model_spec(path))


def test_a_dummy_model_in_an_fp_mode_loads_as_the_planner_counts(tmp_path):
    config = {**TINY_CONFIGS["qwen3"], "vocab_size": SMALL_VOCAB,
              "quantization": {"group_size": 16, "bits": 4, "mode": "nvfp4"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = read_model_spec(str(tmp_path), "dummy")
    stages = _stages(spec)
    assert all(isinstance(s.layers[0].mlp.up_proj, nn.QuantizedLinear) and s.layers[0].mlp.up_proj.mode == "nvfp4"
               for s in stages)
    _assert_facts_equal_the_stages(spec, stages, dense=False)


def test_serve_refuses_a_mode_mlx_cannot_serve_before_any_stage_loads(tmp_path, capsys):
    # The CLI's entry point in this process; unmarked, so tests/fast_tier.py fails the test if serve starts a
    # process or Ray before refusing.
    from stagemesh.cli import main

    bad = {"group_size": 64, "bits": 4, "model.layers.1.mlp.down_proj": {"group_size": 32, "bits": 8, "mode": "nvfp4"}}
    (tmp_path / "config.json").write_text(json.dumps({**TINY_CONFIGS["qwen3"], "quantization": bad}))
    code = main(["serve", str(tmp_path), "--load-format", "dummy", "-pp", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert "module model.layers.1.mlp.down_proj uses nvfp4 8-bit, group size 32 quantization" in err
    assert "nvfp4 with 4 bits in groups of 16" in err
