"""GGUF -> MLX directory: mlx-lm loads it and computes the same bits as our GGUF path."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import llama
from mlx_lm.utils import load

from stage_worker.checkpoint.convert import convert_gguf_to_mlx_dir
from stage_worker.checkpoint.default_model import default_model_path
from stage_worker.checkpoint.model_reader import read_model_spec
from stage_worker.checkpoint.stage_weights import load_stage_weights
from stage_worker.checkpoint.tokenizer import load_tokenizer

pytestmark = pytest.mark.e2e

DEFAULT = default_model_path()
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    return Path(convert_gguf_to_mlx_dir(DEFAULT, str(tmp_path_factory.mktemp("smollm2-mlx"))))


@pytest.fixture(scope="module")
def gguf_model():
    """The model built from the GGUF through our loader, quantized per module."""
    spec = read_model_spec(DEFAULT)
    weights = load_stage_weights(spec, range(0, spec.num_layers), with_embedding=True, with_head=True)
    model = llama.Model(llama.ModelArgs.from_dict(dict(spec.args)))

    def predicate(path, module):
        if f"{path}.scales" not in weights:
            return False
        return spec.quantization_for(path).as_kwargs()

    nn.quantize(model, class_predicate=predicate)
    model.load_weights(list(weights.items()), strict=True)
    return model, load_tokenizer(spec)


def test_directory_layout(converted):
    assert {p.name for p in converted.iterdir()} >= {
        "config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    }
    config = json.loads((converted / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert config["quantization"] == {"group_size": 32, "bits": 4, "model.embed_tokens": {"group_size": 32, "bits": 8}}
    assert config["rope_traditional"] is False and config["tie_word_embeddings"] is True
    assert json.loads((converted / "generation_config.json").read_text())["eos_token_id"] == 2


def test_mlx_lm_logits_are_bit_identical(converted, gguf_model):
    model, tokenizer = gguf_model
    reference, wrapper = load(str(converted))
    assert 2 in wrapper.eos_token_ids
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert wrapper.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False) == prompt
    tokens = mx.array([tokenizer.encode(prompt + "The capital of France is")])
    ours, theirs = model(tokens), reference(tokens)
    assert ours.dtype == theirs.dtype
    assert mx.array_equal(ours, theirs).item()
    # and the model is sane: greedy next word after the teacher-forced prefix
    assert tokenizer.decode([mx.argmax(ours[0, -1]).item()]) == " Paris"


def test_sharded_conversion_loads_the_same(converted, tmp_path):
    sharded = Path(convert_gguf_to_mlx_dir(DEFAULT, str(tmp_path / "sharded"), max_shard_bytes=12_000_000))
    index = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    files_per_layer = {}
    for name, file in index.items():
        if name.startswith("model.layers."):
            files_per_layer.setdefault(int(name.split(".")[2]), set()).add(file)
    assert all(len(files) == 1 for files in files_per_layer.values())  # no layer is split
    assert len(set(index.values())) > 1
    single = load_stage_weights(read_model_spec(str(converted)), range(0, 30), True, True)
    many = load_stage_weights(read_model_spec(str(sharded)), range(0, 30), True, True)
    assert set(single) == set(many)
    assert all(mx.array_equal(single[k], many[k]).item() for k in single)
    reference, _ = load(str(sharded))
    tokens = mx.array([[1, 4093, 198, 19556, 2]])
    model_single, _ = load(str(converted))
    assert mx.array_equal(reference(tokens), model_single(tokens)).item()


def test_the_command_shows_a_progress_bar_of_the_bytes_converted(tmp_path):
    import os
    import subprocess
    import sys

    from stage_worker.checkpoint.gguf.format import read_gguf_header

    total = sum(info.nbytes for info in read_gguf_header(DEFAULT).tensors.values())
    env = {**os.environ, "COLUMNS": "120"}
    done = subprocess.run([sys.executable, "-m", "stagemesh.cli", "convert", DEFAULT, str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    assert "converting" in done.stderr
    # rich's DownloadColumn shows "done/total MB" at the end: every byte of the file's tensors was read.
    megabytes = f"{total / 1e6:.1f}"
    assert f"{megabytes}/{megabytes} MB" in done.stderr, done.stderr[-500:]
