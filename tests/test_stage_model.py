"""A stage's model slice: only its own weights, and slices chained equal the whole model."""

import json
import subprocess
import sys

import mlx.core as mx
import pytest

from stage_worker.checkpoint.default_model import resolve_model_path
from stage_worker.checkpoint.model_reader import read_model_spec
from stage_worker.model.stage_model import StageModel, StageRole, resolve_compute_dtype
from stagemesh_core.layer_split import LayerRange, even_split

_MEASURE = """
import json, sys
import mlx.core as mx
from stagemesh_core.layer_split import LayerRange
from stage_worker.checkpoint.model_reader import read_model_spec
from stage_worker.model.stage_model import StageModel, StageRole
path, start, end, first, last = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1", sys.argv[5] == "1"
model = StageModel.load(read_model_spec(path), StageRole(LayerRange(start, end), first, last), mx.float32)
print(json.dumps({"weight_bytes": model.weight_bytes, "layer_bytes": model.layer_bytes,
                  "peak": mx.get_peak_memory()}))
"""


def measure_stage(path: str, layers: LayerRange, first: bool, last: bool) -> dict:
    """Load one slice in a fresh process, so its peak memory is its own."""
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, path, str(layers.start), str(layers.end), str(int(first)), str(int(last))],
        check=True, capture_output=True, text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def default_path():
    return resolve_model_path(None)


@pytest.mark.e2e
def test_middle_stage_of_three_materializes_a_third_of_the_layers(default_path):
    whole = measure_stage(default_path, LayerRange(0, 30), True, True)
    middle = measure_stage(default_path, LayerRange(10, 20), False, False)
    assert middle["layer_bytes"] == middle["weight_bytes"]  # no embedding, norm or head
    assert middle["weight_bytes"] / whole["layer_bytes"] == pytest.approx(1 / 3, rel=0.05)
    # Peak memory while loading stays near the slice: the whole model was never materialized.
    assert middle["peak"] < 1.25 * middle["weight_bytes"]
    assert middle["peak"] < 0.3 * whole["peak"]


@pytest.mark.e2e
def test_ends_hold_embedding_and_head(default_path):
    spec = read_model_spec(default_path)
    first = StageModel.load(spec, StageRole(LayerRange(0, 15), True, False), mx.float32)
    last = StageModel.load(spec, StageRole(LayerRange(15, 30), False, True), mx.float32)
    assert first.weight_bytes > first.layer_bytes  # + embedding
    assert last.weight_bytes > last.layer_bytes  # + norm and the tied head
    with pytest.raises(AttributeError):
        first.logits(mx.zeros((1, spec.hidden_size)))


@pytest.mark.e2e
def test_three_slices_chained_equal_the_whole_model_bit_for_bit(default_path):
    spec = read_model_spec(default_path)
    whole = StageModel.load(spec, StageRole(LayerRange(0, 30), True, True), mx.float32)
    ranges = even_split(30, 3)
    stages = [StageModel.load(spec, StageRole(r, i == 0, i == 2), mx.float32) for i, r in enumerate(ranges)]
    prompt = mx.array([504, 3575, 282, 4649, 314], dtype=mx.int32)
    whole_caches = whole.new_caches()
    stage_caches = [s.new_caches() for s in stages]
    h_whole, h_stage = whole.embed(prompt), stages[0].embed(prompt)
    for _ in range(6):
        h_whole = whole.run_layers(h_whole, whole_caches)
        for stage, caches in zip(stages, stage_caches):
            h_stage = stage.run_layers(h_stage, caches)
            mx.eval(h_stage)  # a stage boundary materializes the hidden states, as the ring does
        expected, got = whole.logits(h_whole[-1:]), stages[-1].logits(h_stage[-1:])
        assert mx.array_equal(expected, got).item()
        token = mx.argmax(expected, axis=-1).astype(mx.int32)
        h_whole, h_stage = whole.embed(token), stages[0].embed(token)


def test_compute_dtype_flag_is_validated():
    assert resolve_compute_dtype("float16") == mx.float16
    with pytest.raises(ValueError, match="--dtype 'float64' is not supported"):
        resolve_compute_dtype("float64")
