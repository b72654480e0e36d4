"""MLX / Hugging Face directories: spec, slicing, shard selection, sanitize, errors."""

from __future__ import annotations

import importlib
import json
import os
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model

from stage_worker.checkpoint.convert import convert_gguf_to_mlx_dir
from stage_worker.checkpoint.default_model import default_model_path
from stage_worker.checkpoint.model_reader import read_model_spec
from stage_worker.checkpoint.model_spec import ModelFormatError, QuantParams
from stage_worker.checkpoint.stage_weights import load_stage_weights

QWEN3 = {
    "model_type": "qwen3",
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "rms_norm_eps": 1e-6,
    "vocab_size": 96,
    "max_position_embeddings": 256,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
}
QWEN2 = {k: v for k, v in QWEN3.items() if k != "head_dim"} | {"model_type": "qwen2", "tie_word_embeddings": False}
QUANT = {"group_size": 32, "bits": 4, "model.embed_tokens": {"group_size": 32, "bits": 8}}
UNQUANTIZED_MODULE = "model.layers.0.mlp.down_proj"  # stored plain, not listed in config


def _unit(name: str) -> str:
    if name.startswith("model.layers."):
        return f"layer{name.split('.')[2]}"
    return name.split(".")[1 if name.startswith("model.") else 0]


def write_model(
    path: Path,
    config: dict,
    *,
    quantization: dict | None = None,
    dtype=mx.float32,
    sharded: bool = True,
    extra: dict[str, mx.array] | None = None,
    seed: int = 0,
) -> dict[str, mx.array]:
    """A random mlx-lm model saved as one shard per layer (+ index) or one file."""
    mx.random.seed(seed)
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))
    model.set_dtype(dtype)
    if quantization:

        def predicate(p, m):
            if not hasattr(m, "to_quantized") or p == UNQUANTIZED_MODULE:
                return False
            return quantization.get(p, True)

        nn.quantize(model, quantization["group_size"], quantization["bits"], class_predicate=predicate)
    weights = dict(tree_flatten(model.parameters())) | (extra or {})
    mx.eval(weights)
    path.mkdir(parents=True, exist_ok=True)
    cfg = dict(config) | ({"quantization": quantization} if quantization else {})
    (path / "config.json").write_text(json.dumps(cfg))
    if not sharded:
        mx.save_safetensors(str(path / "model.safetensors"), weights)
        return weights
    units: dict[str, dict[str, mx.array]] = {}
    for name, value in weights.items():
        units.setdefault(_unit(name), {})[name] = value
    index = {}
    for i, (_unit_name, tensors) in enumerate(sorted(units.items()), start=1):
        file = f"model-{i:05d}-of-{len(units):05d}.safetensors"
        mx.save_safetensors(str(path / file), tensors)
        index.update({k: file for k in tensors})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    return weights


def assert_same(ours: dict[str, mx.array], expected: dict[str, mx.array], names) -> None:
    assert set(ours) == set(names)
    for name in names:
        assert ours[name].dtype == expected[name].dtype, name
        assert mx.array_equal(ours[name], expected[name]).item(), name


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-tiny-4bit")
    return path, write_model(path, QWEN3, quantization=QUANT)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The default model converted to an MLX dir; shards hold whole layers, ~5 per shard."""
    path = tmp_path_factory.mktemp("smollm2-mlx")
    convert_gguf_to_mlx_dir(default_model_path(), str(path), max_shard_bytes=12_000_000)
    return path


def test_quantized_qwen3_spec(qwen3_dir):
    path, _ = qwen3_dir
    spec = read_model_spec(str(path))
    assert (spec.format, spec.model_type, spec.num_layers, spec.tie_word_embeddings) == ("mlx", "qwen3", 3, True)
    assert spec.default_served_name == path.name
    assert spec.quantization_for("model.embed_tokens") == QuantParams(32, 8)
    assert spec.quantization_for("model.layers.2.self_attn.o_proj") == QuantParams(32, 4)
    assert spec.quantization_for(UNQUANTIZED_MODULE) is None  # inferred from the missing scales
    assert "quantization" not in spec.args


def test_slices_of_a_quantized_qwen3(qwen3_dir):
    path, saved = qwen3_dir
    spec = read_model_spec(str(path))
    middle = load_stage_weights(spec, range(1, 2), with_embedding=False, with_head=False)
    assert_same(middle, saved, [k for k in saved if k.startswith("model.layers.1.")])
    first = load_stage_weights(spec, range(0, 1), with_embedding=True, with_head=False)
    assert_same(first, saved, [k for k in saved if k.startswith(("model.layers.0.", "model.embed_tokens."))])
    assert f"{UNQUANTIZED_MODULE}.scales" not in first and f"{UNQUANTIZED_MODULE}.weight" in first
    last = load_stage_weights(spec, range(2, 3), with_embedding=False, with_head=True)
    # tied: the head needs the embedding matrix
    assert_same(last, saved,
                [k for k in saved if k.startswith(("model.layers.2.", "model.embed_tokens.", "model.norm."))])


def test_names_match_mlx_lm_loader(qwen3_dir):
    path, _ = qwen3_dir
    model, _ = load_model(Path(path))
    reference = dict(tree_flatten(model.parameters()))
    spec = read_model_spec(str(path))
    ours = load_stage_weights(spec, range(0, 3), with_embedding=True, with_head=True)
    assert_same(ours, reference, list(reference))


def test_untied_bf16_hf_checkpoint_and_sanitize(tmp_path):
    extra = {"model.layers.0.self_attn.rotary_emb.inv_freq": mx.ones((16,))}
    saved = write_model(tmp_path, QWEN2, dtype=mx.bfloat16, sharded=False, extra=extra)
    # Some HF configs omit tie_word_embeddings (transformers' default: untied); a stored lm_head decides.
    config = json.loads((tmp_path / "config.json").read_text())
    del config["tie_word_embeddings"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = read_model_spec(str(tmp_path))
    assert spec.quantization is None and spec.tie_word_embeddings is False and spec.model_type == "qwen2"
    last = load_stage_weights(spec, range(2, 3), with_embedding=False, with_head=True)
    assert_same(last, saved, [k for k in saved if k.startswith(("model.layers.2.", "model.norm.", "lm_head."))])
    assert last["lm_head.weight"].dtype == mx.bfloat16
    first = load_stage_weights(spec, range(0, 1), with_embedding=True, with_head=False)
    assert not any("inv_freq" in k for k in first)  # sanitize drops rotary frequencies
    assert "model.layers.0.self_attn.q_proj.bias" in first


def test_tied_model_drops_a_stored_lm_head(tmp_path):
    saved = write_model(tmp_path, QWEN3, sharded=False, extra={"lm_head.weight": mx.zeros((96, 64))})
    spec = read_model_spec(str(tmp_path))
    last = load_stage_weights(spec, range(2, 3), with_embedding=False, with_head=True)
    assert "lm_head.weight" not in last and "model.embed_tokens.weight" in last
    assert mx.array_equal(last["model.embed_tokens.weight"], saved["model.embed_tokens.weight"]).item()


def test_only_needed_shards_are_opened(qwen3_dir, tmp_path):
    source, saved = qwen3_dir
    copy = tmp_path / "copy"
    shutil.copytree(source, copy)
    index = json.loads((copy / "model.safetensors.index.json").read_text())["weight_map"]
    needed = {index[k] for k in index if k.startswith("model.layers.1.")}
    for file in set(index.values()) - needed:
        (copy / file).write_bytes(os.urandom(64))  # unreadable if anything opened it
    spec = read_model_spec(str(copy))  # the spec comes from the index alone
    middle = load_stage_weights(spec, range(1, 2), with_embedding=False, with_head=False)
    assert_same(middle, saved, [k for k in saved if k.startswith("model.layers.1.")])
    with pytest.raises(ModelFormatError, match="cannot read"):
        load_stage_weights(spec, range(0, 1), with_embedding=False, with_head=False)


@pytest.mark.e2e
def test_middle_third_of_converted_default_model(converted, tmp_path):
    index = json.loads((converted / "model.safetensors.index.json").read_text())["weight_map"]
    shards_by_layer = {int(k.split(".")[2]): f for k, f in index.items() if k.startswith("model.layers.")}
    needed = {shards_by_layer[i] for i in range(10, 20)}
    assert len(set(index.values())) == 7 and len(needed) == 2  # shards align with layers
    copy = tmp_path / "copy"
    shutil.copytree(converted, copy)
    for file in set(index.values()) - needed:
        (copy / file).write_bytes(b"\0" * 16)
    spec = read_model_spec(str(copy))
    before = mx.get_active_memory()
    middle = load_stage_weights(spec, range(10, 20), with_embedding=False, with_head=False)
    retained = mx.get_active_memory() - before
    assert {int(k.split(".")[2]) for k in middle} == set(range(10, 20))
    nbytes = sum(v.nbytes for v in middle.values())
    all_layers = load_stage_weights(read_model_spec(str(converted)), range(0, 30), False, False)
    assert abs(nbytes / sum(v.nbytes for v in all_layers.values()) - 1 / 3) < 0.05 / 3
    assert retained <= nbytes * 1.02
    # the same bits as the GGUF path
    gguf_middle = load_stage_weights(read_model_spec(default_model_path()), range(10, 20), False, False)
    assert_same(middle, gguf_middle, list(gguf_middle))


@pytest.mark.e2e
def test_converted_first_and_last_stage(converted):
    spec = read_model_spec(str(converted))
    assert spec.quantization_for("model.embed_tokens") == QuantParams(32, 8) and spec.tie_word_embeddings
    first = load_stage_weights(spec, range(0, 10), True, False)
    assert "model.embed_tokens.scales" in first and "model.norm.weight" not in first
    last = load_stage_weights(spec, range(20, 30), False, True)
    assert {"model.norm.weight", "model.embed_tokens.weight"} <= set(last)
    assert not any(k.startswith("lm_head") for k in last)


# ---------------------------------------------------------------- errors


def _config_dir(tmp_path: Path, **config) -> str:
    write_model(tmp_path, QWEN3, sharded=False)
    cfg = json.loads((tmp_path / "config.json").read_text()) | config
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


@pytest.mark.parametrize(("model_type", "reason"), [
    ("gemma2", "mlx-lm implements it, but stagemesh has not verified its split"),
    ("no_such_model", "mlx-lm has no implementation of it"),
    ("gemma4_text", "cannot be split across pipeline stages: its later layers reuse the keys and values"),
])
def test_unsupported_architecture_is_refused_by_name_with_the_reason(tmp_path, model_type, reason):
    with pytest.raises(ModelFormatError, match=rf"'{model_type}' model.*{reason}.*stagemesh serves llama, qwen2, "
                                               rf"qwen3, deepseek_v3"):
        read_model_spec(_config_dir(tmp_path, model_type=model_type))


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"quantization_config": {"quant_method": "awq", "bits": 4}}, "quantized with 'awq'"),
        ({"quantization": {"group_size": 64, "bits": 4, "mode": "mxfp4"}}, "mxfp4 4-bit, group size 64"),
        ({"quantization": {"group_size": 32, "bits": 7}}, "affine 7-bit, group size 32 quantization"),
        ({"quantization": {"group_size": 32, "bits": 4, "lm_head": {"group_size": 48, "bits": 4}}},
         "module lm_head uses affine 4-bit, group size 48"),
    ],
)
def test_unsupported_quantization(tmp_path, config, message):
    with pytest.raises(ModelFormatError, match=message):
        read_model_spec(_config_dir(tmp_path, **config))


def test_missing_weights_and_shards(tmp_path, qwen3_dir):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps(QWEN3))
    with pytest.raises(ModelFormatError, match="no model\\*.safetensors"):
        read_model_spec(str(empty))
    copy = tmp_path / "copy"
    shutil.copytree(qwen3_dir[0], copy)
    index = json.loads((copy / "model.safetensors.index.json").read_text())["weight_map"]
    (copy / index["model.layers.2.mlp.up_proj.weight"]).unlink()
    spec = read_model_spec(str(copy))
    load_stage_weights(spec, range(0, 2), True, False)  # other shards still serve
    with pytest.raises(ModelFormatError, match="is missing"):
        load_stage_weights(spec, range(2, 3), False, False)
