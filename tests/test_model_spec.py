"""ModelSpec: what the default model is, quantization lookup, dispatch, path resolution."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
from mlx_lm.models import llama

from stage_worker.checkpoint import default_model
from stage_worker.checkpoint.default_model import (
    DEFAULT_GGUF_NAME,
    DEFAULT_SERVED_NAME,
    default_model_path,
    resolve_model_path,
)
from stage_worker.checkpoint.gguf.format import read_gguf_header
from stage_worker.checkpoint.model_reader import read_model_spec
from stage_worker.checkpoint.model_spec import ModelFormatError, ModelSpec, QuantParams, served_name_from_path

DEFAULT = default_model_path()


@pytest.fixture(scope="module")
def spec() -> ModelSpec:
    return read_model_spec(DEFAULT)


def test_default_model_spec(spec):
    assert (spec.format, spec.model_type) == ("gguf", "llama")
    assert (spec.num_layers, spec.hidden_size, spec.vocab_size) == (30, 576, 49152)
    assert spec.tie_word_embeddings is True
    assert spec.default_served_name == DEFAULT_SERVED_NAME
    args = llama.ModelArgs.from_dict(dict(spec.args))
    assert (args.num_attention_heads, args.num_key_value_heads, args.head_dim) == (9, 3, 64)
    assert (args.intermediate_size, args.rms_norm_eps, args.rope_theta) == (1536, 1e-05, 100000.0)
    assert args.rope_traditional is False and args.max_position_embeddings == 8192
    assert dict(spec.quantization) == {"group_size": 32, "bits": 4, "model.embed_tokens": {"group_size": 32, "bits": 8}}
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.num_layers = 3  # type: ignore[misc]


def test_quantization_for(spec):
    assert spec.quantization_for("model.embed_tokens") == QuantParams(32, 8)
    assert spec.quantization_for("model.layers.12.self_attn.q_proj") == QuantParams(32, 4, "affine")
    partly = dataclasses.replace(spec, quantization={"group_size": 64, "bits": 4, "lm_head": False})
    assert partly.quantization_for("lm_head") is None
    assert partly.quantization_for("model.layers.0.mlp.up_proj") == QuantParams(64, 4)
    assert dataclasses.replace(spec, quantization=None).quantization_for("model.embed_tokens") is None


def test_spec_reads_no_tensor_data(tmp_path):
    """A copy whose tensor bytes are all zero (sparse) gives the same spec."""
    header = read_gguf_header(DEFAULT)
    data_start = min(t.offset for t in header.tensors.values())
    hollow = tmp_path / DEFAULT_GGUF_NAME
    with open(DEFAULT, "rb") as src, open(hollow, "wb") as dst:
        dst.write(src.read(data_start))
        dst.truncate(Path(DEFAULT).stat().st_size)
    a, b = read_model_spec(DEFAULT), read_model_spec(str(hollow))
    assert dataclasses.replace(b, path=a.path) == a


def test_missing_and_unknown_paths(tmp_path):
    with pytest.raises(ModelFormatError, match="does not exist"):
        read_model_spec(str(tmp_path / "nope.gguf"))
    with pytest.raises(ModelFormatError, match="without config.json"):
        read_model_spec(str(tmp_path))
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(ModelFormatError, match="neither a .gguf"):
        read_model_spec(str(other))


@pytest.mark.parametrize(
    ("path", "name"),
    [
        ("/m/SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
        ("/m/Qwen3-0.6B-Q8_0.gguf", "Qwen3-0.6B"),
        ("/m/model-f16.gguf", "model"),
        ("/m/Llama-3.2-1B-Instruct-4bit/", "Llama-3.2-1B-Instruct-4bit"),
        ("/h/hub/models--mlx-community--Qwen3-0.6B-4bit/snapshots/abc123", "mlx-community/Qwen3-0.6B-4bit"),
    ],
)
def test_served_names(path, name):
    assert served_name_from_path(path) == name


def test_resolve_model_path(tmp_path, monkeypatch):
    assert resolve_model_path(None) == DEFAULT
    assert resolve_model_path(DEFAULT) == DEFAULT
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
    with pytest.raises(ModelFormatError, match="not in the local Hugging Face cache"):
        resolve_model_path("stagemesh-test-org/no-such-model")
    with pytest.raises(ModelFormatError, match="does not exist"):
        resolve_model_path(str(tmp_path / "missing.gguf"))


def test_default_model_falls_back_to_the_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(default_model, "_from_package", lambda: None)
    monkeypatch.setenv("STAGEMESH_CACHE_DIR", str(tmp_path))
    cached = tmp_path / DEFAULT_GGUF_NAME
    shutil.copyfile(DEFAULT, cached)
    assert default_model_path() == str(cached)
