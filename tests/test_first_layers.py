"""``--shape-layers N``: a shape's config cut to its first N decoder layers builds in mlx-lm as those very layers
(same parameters, same kind of cache each), refuses a count that breaks the layer pattern, travels to the stages
in the plan, and bench kinds and ``stagemesh plan`` take it."""

from __future__ import annotations

import argparse
import importlib
import json
from dataclasses import replace

import pytest

from stage_worker.checkpoint.first_layers import first_layers_config, least_layers
from stage_worker.checkpoint.mlx_arch import describe
from stage_worker.checkpoint.model_reader import read_model_spec
from stage_worker.checkpoint.model_spec import ModelFormatError
from stagemesh.bench.random_checkpoint import SHAPES_DIR, check_shape_flags, shape_config
from stagemesh_core.errors import UserError
from stagemesh_core.plan import PipelinePlan, StageLaunch, make_local_plan

MOE_SHAPES = ("deepseek-v3", "gemma-3-27b", "gpt-oss-20b", "gpt-oss-120b", "mixtral-8x7b", "qwen3-235b-a22b",
              "qwen3-30b-a3b", "qwen3-next-80b-a3b")


def _layer_shapes(model_type: str, config: dict, count: int) -> list[dict[str, tuple[int, ...]]]:
    """Each of the first ``count`` layers' parameter names and shapes in mlx-lm's lazily built model."""
    from mlx.utils import tree_flatten

    arch = importlib.import_module(f"mlx_lm.models.{model_type}")
    model = arch.Model(arch.ModelArgs.from_dict(config))
    assert len(model.layers) == config["num_hidden_layers"]
    return [{name: tuple(a.shape) for name, a in tree_flatten(model.layers[i].parameters())} for i in range(count)]


@pytest.mark.parametrize("shape", MOE_SHAPES)
def test_the_first_layers_are_the_whole_models_first_layers(shape):
    whole = shape_config(shape)
    n = max(least_layers(whole)[0], 6)  # past DeepSeek's three dense layers and a Gemma 3 pattern
    cut = shape_config(shape, n)
    assert cut["num_hidden_layers"] == n
    model_type = whole["model_type"]
    assert _layer_shapes(model_type, cut, n) == _layer_shapes(model_type, whole, n)
    assert describe(model_type, cut).cache_kinds == describe(model_type, whole).cache_kinds[:n]
    assert describe(model_type, cut).windows == describe(model_type, whole).windows[:n]


def test_per_layer_lists_are_cut_and_layer_indices_kept_below_n():
    config = {"model_type": "x", "num_hidden_layers": 6, "layer_types": list("ababab"),
              "no_rope_layers": [1, 0, 1, 0, 1, 0], "mlp_only_layers": [0, 3, 5], "eos_token_id": [1, 2, 3],
              "first_k_dense_replace": 3}
    cut = first_layers_config(config, 3)
    assert cut == {**config, "num_hidden_layers": 3, "layer_types": list("aba"), "no_rope_layers": [1, 0, 1],
                   "mlp_only_layers": [0]}


@pytest.mark.parametrize("shape,n,message", [
    ("gpt-oss-20b", 1, "one of each of its layer types (full_attention, sliding_attention); use at least 2"),
    ("qwen3-next-80b-a3b", 3, "every 4th layer is full attention, the others linear attention; use at least 4"),
    ("gemma-3-27b", 5, "5 sliding-window layers and a global one; use at least 6"),
    ("qwen3-30b-a3b", 49, "exceeds the model's 48 decoder layers; use 48 or fewer"),
    ("mixtral-8x7b", 0, "must be at least 1"),
])
def test_a_count_that_breaks_the_model_is_refused_with_the_least_that_works(shape, n, message):
    with pytest.raises(ModelFormatError, match=message.replace("(", r"\(").replace(")", r"\)")):
        shape_config(shape, n)


def test_the_cut_travels_to_every_stage_in_the_plan():
    spec = read_model_spec(str(SHAPES_DIR / "qwen3-30b-a3b"), "dummy", 12)
    assert spec.num_layers == 12 and spec.args["num_hidden_layers"] == 12
    plan = replace(make_local_plan(spec.path, 12, 2, "auto", load_format="dummy"), first_layers=12)
    assert StageLaunch.from_json(StageLaunch(plan, 0).to_json()).plan.first_layers == 12
    assert PipelinePlan.from_dict({k: v for k, v in json.loads(plan.to_json()).items() if k != "first_layers"}
                                  ).first_layers is None  # a plan written without it: the whole model
    with pytest.raises(ModelFormatError, match="--shape-layers 12 cuts the config.json of a model directory served "
                                               "with --load-format dummy"):
        read_model_spec(str(SHAPES_DIR / "qwen3-30b-a3b"), "auto", 12)


def test_bench_kinds_take_shape_layers_with_a_shape_only():
    def args(**given) -> argparse.Namespace:
        return argparse.Namespace(**{"model": None, "shape": None, "shape_layers": None, "shape_quantization": None,
                                     **given})

    check_shape_flags(args(shape="qwen3-30b-a3b", shape_layers=12))
    with pytest.raises(UserError, match="give --shape NAME too"):
        check_shape_flags(args(model="m", shape_layers=12))
    with pytest.raises(UserError, match="use at least 2"):
        check_shape_flags(args(shape="gpt-oss-20b", shape_layers=1))
    with pytest.raises(UserError, match="--shape-quantization quantizes a --shape model; give --shape NAME too"):
        check_shape_flags(args(model="m", shape_quantization="mxfp4"))


def test_plan_and_serve_take_shape_layers(capsys):
    # The CLI's entry point in this process, for assumed nodes: unmarked, so tests/fast_tier.py fails the test if
    # the plan starts a process or Ray.
    from stagemesh.cli import main

    def run(*extra: str) -> tuple[int, str, str]:
        code = main(["plan", "--load-format", "dummy", "qwen3-30b-a3b", "--assume-node", "a=96GB", "--json", *extra])
        return code, *capsys.readouterr()

    code, out, err = run("--shape-layers", "12")
    assert code == 0, err
    plan = json.loads(out)
    assert plan["num_layers"] == 12 and plan["replicas"][0]["stages"][0]["layers"] == [0, 12]
    code, _, err = run("--shape-layers", "49")
    assert code == 2 and "--shape-layers 49 exceeds the model's 48 decoder layers" in err
