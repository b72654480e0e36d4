"""Checkpoints as people have them: Hugging Face's original layout (one tensor per expert) serves like mlx-lm's
own layout."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

from stage_worker.model_spec import read_model_spec
from stage_worker.stage_model import StageModel, StageRole
from stagemesh.core.layer_split import LayerRange, even_split
from tests.architectures import HF_EXPERTS, hf_layout_checkpoint, tiny_checkpoint
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
    expected = _mlx_lm_greedy(path)
    assert expected == _mlx_lm_greedy(tiny_checkpoint(name, root))  # the same model in either layout
    for depth in (1, 2, 3):
        stages = [StageModel.load(spec, StageRole(LayerRange(r.start, r.end), i == 0, i == depth - 1), mx.float32)
                  for i, r in enumerate(even_split(spec.num_layers, depth))]
        with InProcessPipeline(stages) as pipeline:
            outputs, _ = read_until_finished([pipeline.submit(p, MAX_TOKENS) for p in PROMPTS])
        assert outputs == expected, f"PP={depth}"
