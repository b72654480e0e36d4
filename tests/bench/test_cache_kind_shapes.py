"""The shipped CPU-scale shapes stand for the cache kind they name: built by mlx-lm from their config, each keeps
the kinds of layer cache its architecture's released models keep, at about the default model's size."""

from __future__ import annotations

import pytest

from stage_worker.checkpoint.mlx_arch import describe
from stagemesh.bench.random_checkpoint import shape_config, shape_names


@pytest.mark.parametrize(("name", "kinds"), [
    ("smollm2-135m", {"kv"}),
    ("small-gpt-oss", {"kv", "rotating"}),
    ("small-gemma3", {"kv", "rotating"}),
    ("small-qwen3-next", {"kv", "arrays"}),
])
def test_each_small_shape_keeps_its_cache_kinds(name, kinds):
    assert name in shape_names()
    config = shape_config(name)
    assert set(describe(config["model_type"], config).cache_kinds) == kinds
    assert config["hidden_size"] == 576 and config["vocab_size"] == 49152  # the default model's width and tokenizer
    # Cut to its first layers (as the agent benchmark runs them), the pattern of kinds is kept.
    cut = shape_config(name, 4 if name != "small-gemma3" else 6)
    assert set(describe(cut["model_type"], cut).cache_kinds) == kinds
