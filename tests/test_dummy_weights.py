"""``--load-format dummy``: random weights for exactly a stage's slice, the same whichever layout makes them."""

import logging

import mlx.core as mx
import pytest

from stage_worker.checkpoint.default_model import resolve_model_path
from stage_worker.checkpoint.dummy_weights import dummy_stage_weights, parameter_shapes
from stage_worker.checkpoint.model_reader import read_model_spec
from stage_worker.checkpoint.model_spec import ModelFormatError
from stage_worker.checkpoint.stage_weights import load_stage_weights
from stage_worker.checkpoint.tokenizer import load_tokenizer
from stage_worker.model.stage_model import StageModel, StageRole
from stagemesh.bench.random_checkpoint import SHAPES_DIR as DUMMY_SHAPES_DIR
from stagemesh.bench.random_checkpoint import shape_names as dummy_shape_names
from stagemesh.serve import ServeConfigError, check_dummy_vocabulary, resolve_model_argument
from stagemesh_core.layer_split import LayerRange
from stagemesh_core.plan import PipelinePlan, StageLaunch, make_local_plan
from tests.conftest import tiny_config


@pytest.fixture
def tiny(tmp_path):
    return read_model_spec(tiny_config(tmp_path / "tiny"), "dummy")


def test_a_directory_with_only_config_json_is_a_dummy_model_and_nothing_else(tmp_path):
    path = tiny_config(tmp_path / "tiny")
    spec = read_model_spec(path, "dummy")
    assert spec.random_weights and spec.format == "mlx" and spec.num_layers == 4 and spec.vocab_size == 512
    with pytest.raises(ModelFormatError, match="model.safetensors"):
        read_model_spec(path)  # auto needs the weights
    with pytest.raises(ModelFormatError, match="--load-format dummy needs a Hugging Face config.json"):
        read_model_spec(str(tmp_path), "dummy")
    with pytest.raises(ModelFormatError, match="--load-format 'random'"):
        read_model_spec(path, "random")


def test_same_name_same_tensor_and_different_names_differ(tiny):
    a = dummy_stage_weights(tiny, range(0, 2), True, False, mx.float32)
    b = dummy_stage_weights(tiny, range(0, 2), True, False, mx.float32)
    assert a.keys() == b.keys()
    assert all(mx.array_equal(a[k], b[k]).item() for k in a)
    q0, q1 = a["model.layers.0.self_attn.q_proj.weight"], a["model.layers.1.self_attn.q_proj.weight"]
    assert not mx.array_equal(q0, q1).item()


def test_only_the_slice_is_made(tiny):
    middle = dummy_stage_weights(tiny, range(1, 3), False, False, mx.float32)
    assert {k.split(".")[2] for k in middle} == {"1", "2"}
    assert all(k.startswith("model.layers.") for k in middle)
    first = dummy_stage_weights(tiny, range(0, 1), True, False, mx.float32)
    assert "model.embed_tokens.weight" in first and "model.norm.weight" not in first
    last = dummy_stage_weights(tiny, range(3, 4), False, True, mx.float32)
    assert {"model.embed_tokens.weight", "model.norm.weight"} <= last.keys()  # tied: the head is the embedding
    assert "lm_head.weight" not in last


def test_untied_head_is_made_on_the_last_stage_only(tmp_path):
    spec = read_model_spec(tiny_config(tmp_path / "untied", tie_word_embeddings=False), "dummy")
    last = dummy_stage_weights(spec, range(2, 4), False, True, mx.float32)
    assert "lm_head.weight" in last and "model.embed_tokens.weight" not in last
    assert "lm_head.weight" not in dummy_stage_weights(spec, range(0, 2), True, False, mx.float32)


def test_layouts_make_the_same_weights(tiny):
    whole = dummy_stage_weights(tiny, range(0, 4), True, True, mx.bfloat16)
    first = dummy_stage_weights(tiny, range(0, 1), True, False, mx.bfloat16)
    middle = dummy_stage_weights(tiny, range(1, 3), False, False, mx.bfloat16)
    last = dummy_stage_weights(tiny, range(3, 4), False, True, mx.bfloat16)
    for part in (first, middle, last):
        for name, array in part.items():
            assert mx.array_equal(array, whole[name]).item(), name
    assert set(first) | set(middle) | set(last) == set(whole)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_shapes_dtype_and_a_real_initialisation(tmp_path, dtype):
    spec = read_model_spec(tiny_config(tmp_path / "qwen2", model_type="qwen2", hidden_size=128, vocab_size=1024,
                                       initializer_range=0.05), "dummy")
    weights = load_stage_weights(spec, range(0, 4), True, True, dtype=dtype)
    shapes = parameter_shapes(spec)
    assert {k: tuple(v.shape) for k, v in weights.items()} == {k: shapes[k] for k in weights}
    assert all(v.dtype == dtype for v in weights.values())
    assert mx.all(weights["model.layers.0.input_layernorm.weight"] == 1).item()
    assert mx.all(weights["model.norm.weight"] == 1).item()
    assert mx.all(weights["model.layers.0.self_attn.q_proj.bias"] == 0).item()  # qwen2's attention biases
    up = weights["model.layers.2.mlp.up_proj.weight"].astype(mx.float32)
    assert abs(mx.mean(up).item()) < 0.005 and mx.sqrt(mx.mean(up * up)).item() == pytest.approx(0.05, rel=0.05)


def test_quantization_block_gives_quantized_weights(tmp_path):
    spec = read_model_spec(tiny_config(tmp_path / "q4", quantization={"group_size": 64, "bits": 4},
                                       tie_word_embeddings=False), "dummy")
    weights = dummy_stage_weights(spec, range(0, 2), True, False, mx.bfloat16)
    assert weights["model.layers.0.mlp.up_proj.weight"].dtype == mx.uint32
    assert weights["model.layers.0.mlp.up_proj.weight"].shape == (128, 64 * 4 // 32)
    assert weights["model.layers.0.mlp.up_proj.scales"].dtype == mx.bfloat16
    assert "model.embed_tokens.scales" in weights
    assert weights["model.layers.0.input_layernorm.weight"].dtype == mx.bfloat16  # norms stay dense
    model = StageModel.load(spec, StageRole(LayerRange(0, 4), True, True), mx.bfloat16)
    assert model.quantized


def test_a_group_size_the_rows_do_not_divide_names_the_module(tmp_path):
    spec = read_model_spec(tiny_config(tmp_path / "bad", hidden_size=96, quantization={"group_size": 64, "bits": 4}),
                           "dummy")
    with pytest.raises(ModelFormatError, match="cannot quantize"):
        dummy_stage_weights(spec, range(0, 1), True, False, mx.float32)


def test_stages_chained_equal_the_whole_model_and_stay_finite_in_float16(tmp_path):
    spec = read_model_spec(tiny_config(tmp_path / "f16", hidden_size=256, intermediate_size=512, vocab_size=2048,
                                       num_attention_heads=8), "dummy")
    whole = StageModel.load(spec, StageRole(LayerRange(0, 4), True, True), mx.float16)
    stages = [StageModel.load(spec, StageRole(LayerRange(0, 2), True, False), mx.float16),
              StageModel.load(spec, StageRole(LayerRange(2, 4), False, True), mx.float16)]
    prompt = mx.array([5, 17, 300, 2000, 9], dtype=mx.int32)
    h_whole = whole.run_layers(whole.embed(prompt), whole.new_caches())
    h_stage = stages[0].embed(prompt)
    for stage in stages:
        h_stage = stage.run_layers(h_stage, stage.new_caches())
        mx.eval(h_stage)
    expected, got = whole.logits(h_whole), stages[-1].logits(h_stage)
    assert mx.all(mx.isfinite(expected)).item()
    assert mx.array_equal(expected, got).item()


@pytest.mark.e2e
def test_a_gguf_lends_its_shapes_and_quantization():
    path = resolve_model_path(None)
    real, dummy = read_model_spec(path), read_model_spec(path, "dummy")
    assert dummy.random_weights and dummy.format == "gguf" and dummy.quantization == real.quantization
    middle = load_stage_weights(dummy, range(10, 12), False, False, dtype=mx.float16)
    stored = load_stage_weights(real, range(10, 12), False, False)
    assert {k: v.shape for k, v in middle.items()} == {k: v.shape for k, v in stored.items()}


def test_a_directory_without_tokenizer_files_borrows_the_default_models(tmp_path, caplog):
    spec = read_model_spec(tiny_config(tmp_path / "tiny", vocab_size=49152), "dummy")
    with caplog.at_level(logging.WARNING, logger="stagemesh.tokenizer"):
        tokenizer = load_tokenizer(spec)
    assert "embedded default model's tokenizer" in caplog.text
    assert tokenizer.decode(tokenizer.encode("Paris", add_special_tokens=False)) == "Paris"
    check_dummy_vocabulary(spec, tokenizer)
    small = read_model_spec(tiny_config(tmp_path / "small"), "dummy")
    with pytest.raises(ServeConfigError, match="vocab_size is 512"):
        check_dummy_vocabulary(small, tokenizer)


def test_load_format_travels_in_the_plan():
    plan = make_local_plan("/models/llama-3.1-8b", 32, 2, "bfloat16", load_format="dummy")
    assert plan.load_format == "dummy"
    assert PipelinePlan.from_json(plan.to_json()) == plan
    assert StageLaunch.from_json(StageLaunch(plan, 1).to_json()).plan.load_format == "dummy"
    assert make_local_plan("/m.gguf", 30, 1, "auto").load_format == "auto"


def test_shipped_shape_names_resolve_to_their_configs(tmp_path):
    assert {"llama-3.2-1b", "llama-3.1-8b", "qwen3-8b"} <= set(dummy_shape_names())
    path = resolve_model_argument("qwen3-8b", "dummy")
    assert path == str(DUMMY_SHAPES_DIR / "qwen3-8b")
    spec = read_model_spec(path, "dummy")
    assert spec.model_type == "qwen3" and spec.num_layers == 36 and not spec.tie_word_embeddings
    assert resolve_model_argument(str(tmp_path), "dummy") == str(tmp_path)
    with pytest.raises(ServeConfigError, match="deepseek-v3, gemma-3-27b, gpt-oss-120b, gpt-oss-20b, llama-3.1-8b, "
                                               "llama-3.2-1b, mixtral-8x7b, qwen3-235b-a22b, qwen3-30b-a3b, "
                                               "qwen3-8b, qwen3-next-80b-a3b"):
        resolve_model_argument("llama-9b", "dummy")


def test_serve_names_the_flag_and_the_known_shapes_for_an_unknown_name(capsys):
    # The CLI's entry point in this process; unmarked, so tests/fast_tier.py fails the test if serve starts a
    # process or Ray before refusing.
    from stagemesh.cli import main

    assert main(["serve", "llama-9b", "--load-format", "dummy"]) == 2
    err = capsys.readouterr().err
    assert "--load-format dummy" in err and "known shapes: deepseek-v3, gemma-3-27b" in err
