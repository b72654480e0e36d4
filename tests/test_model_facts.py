"""The planner's model sizes equal what a stage really loads (the real default model, quantized and dense)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from stage_worker.checkpoint.model_reader import read_model_spec
from stage_worker.model.model_facts import model_facts
from stage_worker.model.stage_model import StageModel, StageRole
from stagemesh_core.layer_split import LayerRange


@pytest.fixture(scope="module")
def spec(default_model_path):
    return read_model_spec(default_model_path)


@pytest.mark.e2e
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
@pytest.mark.parametrize("start,end,first,last", [(0, 30, True, True), (0, 12, True, False),
                                                  (12, 21, False, False), (21, 30, False, True)])
def test_stage_weight_bytes_match_the_loaded_slice(spec, dtype, start, end, first, last):
    facts = model_facts(spec)
    model = StageModel.load(spec, StageRole(LayerRange(start, end), first, last), dtype)
    size = facts.stage_weight_bytes(end - start, first=first, last=last, element_bytes=dtype.size)
    assert size == model.weight_bytes
    dense = model_facts(spec, dense=True).stage_weight_bytes(end - start, first=first, last=last,
                                                             element_bytes=dtype.size)
    assert dense == model.dense_bytes()


def test_kv_per_token_and_tied_head(spec):
    facts = model_facts(spec)
    assert facts.tied_embeddings and facts.num_layers == 30
    assert facts.kv_elements_per_token == 2 * 3 * 64  # keys and values, 3 KV heads of 64
    assert facts.head.packed == facts.embedding.packed  # the tied head is the Q8 embedding itself
