"""Layer split: even by default, explicit boundaries validated up front."""

import pytest

from stagemesh.cli import main
from stagemesh_core.layer_split import LayerRange, LayerSplitError, even_split, parse_layer_split, plan_layer_split


def test_even_split_tiles_the_model_and_gives_the_remainder_to_early_stages():
    assert even_split(30, 3) == (LayerRange(0, 10), LayerRange(10, 20), LayerRange(20, 30))
    assert [len(r) for r in even_split(30, 4)] == [8, 8, 7, 7]
    assert even_split(30, 1) == (LayerRange(0, 30),)


@pytest.mark.parametrize("layers,stages", [(30, 2), (30, 7), (28, 3), (5, 5)])
def test_even_split_is_contiguous(layers, stages):
    split = even_split(layers, stages)
    assert split[0].start == 0 and split[-1].end == layers
    assert all(a.end == b.start for a, b in zip(split, split[1:]))
    assert max(map(len, split)) - min(map(len, split)) <= 1


def test_more_stages_than_layers_names_the_flag():
    with pytest.raises(LayerSplitError, match="--pipeline-parallel-size 31 exceeds the model's 30"):
        even_split(30, 31)


def test_explicit_split_is_parsed():
    assert parse_layer_split("10,20", 30, 3) == (LayerRange(0, 10), LayerRange(10, 20), LayerRange(20, 30))
    assert plan_layer_split(30, 2, "5") == (LayerRange(0, 5), LayerRange(5, 30))
    assert plan_layer_split(30, 2, None) == even_split(30, 2)


@pytest.mark.parametrize(
    "spec,message",
    [
        ("10", "gives 1 boundaries, but --pipeline-parallel-size 3 needs exactly 2"),
        ("10,x", "must be comma-separated integers"),
        ("20,10", "not strictly increasing"),
        ("0,10", "not strictly increasing"),
        ("10,30", "not strictly increasing"),
        ("10,10", "not strictly increasing"),
    ],
)
def test_bad_explicit_split_says_what_to_change(spec, message):
    with pytest.raises(LayerSplitError, match=message):
        parse_layer_split(spec, 30, 3)


def test_the_parity_tool_refuses_a_bad_split_before_anything_starts(capsys):
    # Unmarked: tests/fast_tier.py fails this test if the command starts a stage process (or Ray).
    assert main(["bench", "parity", "-pp", "3", "--pp-layer-split", "20,10"]) == 2
    assert "--pp-layer-split '20,10' is not strictly increasing" in capsys.readouterr().err
