"""Checkpoints as people have them: Hugging Face's original layout (one tensor per expert) serves like mlx-lm's
own layout, and files that disagree with their config.json (a missing expert, a wrong shape) are named tensor by
tensor before any stage starts, and again by the stage that would load them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest

from stage_worker.checkpoint.checkpoint_check import check_checkpoint
from stage_worker.checkpoint.model_reader import read_model_spec
from stage_worker.checkpoint.model_spec import ModelFormatError
from stage_worker.model.stage_model import StageModel, StageRole
from stagemesh.cli import main
from stagemesh_core.layer_split import LayerRange, even_split
from tests.architectures import HF_EXPERTS, TINY_CONFIGS, hf_layout_checkpoint, tiny_checkpoint
from tests.engine_helpers import InProcessPipeline, read_until_finished

PROMPTS = ((504, 3575, 282, 4649, 314, 1018, 28, 2270, 253, 11, 12), (1, 2, 3), (17, 42, 99, 1000, 5, 6))
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("layouts")


def _mlx_lm_greedy(path: str) -> list[list[int]]:
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load

    model, _ = load(path)  # mlx-lm sanitizes the whole checkpoint: the experts stacked
    return [[int(t) for t, _ in generate_step(mx.array(p), model, max_tokens=MAX_TOKENS,
                                               sampler=lambda logits: mx.argmax(logits, axis=-1))] for p in PROMPTS]


@pytest.mark.parametrize("name", sorted(HF_EXPERTS))
def test_hugging_faces_layout_serves_as_mlx_lm_generates_at_every_depth(root, name):
    path = hf_layout_checkpoint(name, root)
    names = set(mx.load(str(Path(path) / "model.safetensors")))
    assert not any("switch_mlp" in n for n in names) and any(".experts.3." in n for n in names)
    spec = read_model_spec(path)
    check_checkpoint(spec)
    expected = _mlx_lm_greedy(path)
    assert expected == _mlx_lm_greedy(tiny_checkpoint(name, root))  # the same model in either layout
    for depth in (1, 2, 3):
        stages = [StageModel.load(spec, StageRole(LayerRange(r.start, r.end), i == 0, i == depth - 1), mx.float32)
                  for i, r in enumerate(even_split(spec.num_layers, depth))]
        with InProcessPipeline(stages) as pipeline:
            outputs, _ = read_until_finished([pipeline.submit(p, MAX_TOKENS) for p in PROMPTS])
        assert outputs == expected, f"PP={depth}"


def _broken(root: Path, source: str, label: str, change) -> str:
    """A copy of ``source`` whose tensors ``change`` edits in place (a dict of name -> array)."""
    out = root / label
    shutil.copytree(source, out, dirs_exist_ok=True)
    weights = dict(mx.load(str(Path(source) / "model.safetensors")))
    change(weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    return str(out)


STACKED = "model.layers.2.mlp.switch_mlp.gate_proj.weight"
EXPERT = "model.layers.2.mlp.experts.7.gate_proj.weight"
BROKEN = {
    # name: (layout, change, what the refusal says)
    "stacked-missing": ("mlx", lambda w: w.pop(STACKED), f"missing {STACKED}"),
    "stacked-seven-experts": ("mlx", lambda w: w.update({STACKED: w[STACKED][:7]}),
                              f"{STACKED} is (7, 32, 64) in model.safetensors, (8, 32, 64) by the config"),
    "expert-missing": ("hf", lambda w: w.pop(EXPERT), f"lacks {EXPERT}, which mlx-lm's qwen3_moe model needs"),
    "expert-wrong-shape": ("hf", lambda w: w.update({EXPERT: w[EXPERT][:16]}),
                           f"{EXPERT} is (16, 64), its layer's other experts (32, 64)"),
}


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_every_served_architectures_checkpoint_passes_the_check(root, name):
    check_checkpoint(read_model_spec(tiny_checkpoint(name, root)))


def test_a_quantized_checkpoint_is_checked_as_quantized(root):
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load, quantize_model

    source = tiny_checkpoint("qwen3_moe", root)
    model, _ = load(source)
    model, config = quantize_model(model, json.loads((Path(source) / "config.json").read_text()), group_size=32,
                                   bits=4)
    weights = dict(tree_flatten(model.parameters()))
    path = _broken(root, source, "q4", lambda w: (w.clear(), w.update(weights)))
    (Path(path) / "config.json").write_text(json.dumps(config))
    check_checkpoint(read_model_spec(path))
    scales = "model.layers.2.mlp.switch_mlp.gate_proj.scales"
    broken = _broken(root, path, "q4-no-scales", lambda w: w.pop(scales))
    with pytest.raises(ModelFormatError, match=r"switch_mlp.gate_proj.weight is \(8, 32, 8\) in model.safetensors, "
                                               r"\(8, 32, 64\) by the config; not in the model: "
                                               r"model.layers.2.mlp.switch_mlp.gate_proj.biases"):
        check_checkpoint(read_model_spec(broken))  # without scales the codes read as a dense weight


@pytest.mark.parametrize("label", sorted(BROKEN))
def test_files_that_disagree_with_the_config_are_named_before_any_stage_loads(root, label):
    layout, change, message = BROKEN[label]
    source = tiny_checkpoint("qwen3_moe", root) if layout == "mlx" else hf_layout_checkpoint("qwen3_moe", root)
    spec = read_model_spec(_broken(root, source, label, change))
    with pytest.raises(ModelFormatError, match="qwen3_moe") as refused:
        check_checkpoint(spec)
    assert message in str(refused.value)


def test_a_stage_names_the_tensor_by_the_checkpoints_layer_number(root):
    """The stage's own check (files changed after serve checked them, or a stage started alone)."""
    spec = read_model_spec(_broken(root, tiny_checkpoint("qwen3_moe", root), "stage-seven", BROKEN[
        "stacked-seven-experts"][1]))
    with pytest.raises(ModelFormatError, match=rf"the weights of layers \[2, 4\) do not match mlx-lm's qwen3_moe "
                                               rf"model for its config.json: {STACKED} is \(7, 32, 64\) in the files, "
                                               rf"\(8, 32, 64\) by the config"):
        StageModel.load(spec, StageRole(LayerRange(2, 4), False, True), mx.float32)


def test_plan_and_serve_exit_2_naming_the_tensor_and_refuse_more_stages_than_layers(root, capsys):
    # The CLI's entry point in this process (``python -m stagemesh.cli`` exits with what it returns); unmarked, so
    # tests/fast_tier.py fails the test if either command starts a process or Ray before refusing.
    def run(*args: str) -> tuple[int, str]:
        code = main(list(args))
        return code, capsys.readouterr().err

    broken = _broken(root, tiny_checkpoint("qwen3_moe", root), "serve-seven", BROKEN["stacked-seven-experts"][1])
    for command in (["plan", broken], ["serve", broken, "--port", "1"]):
        code, err = run(*command)
        assert code == 2, err
        assert f"{STACKED} is (7, 32, 64) in model.safetensors, (8, 32, 64) by the config" in err
        assert "Traceback" not in err
    layers = json.loads((Path(broken) / "config.json").read_text())["num_hidden_layers"]
    code, err = run("plan", tiny_checkpoint("qwen3_moe", root), "-pp", str(layers + 1))
    assert code == 2 and "Traceback" not in err
    assert f"--pipeline-parallel-size {layers + 1} exceeds the model's {layers} decoder layers" in err
