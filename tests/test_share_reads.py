"""A tensor-parallel member reads its part of each tensor alone: parts of real safetensors files against numpy's
cut of the whole (``safetensors_format``), parts of the default model's GGUF blocks against the whole
conversion's cut, on runs inside blocks and heads (``read_gguf_part``), the cut traced on probes
(``share_reads.trace_cut``) for mlx's own cuts, a cut that computes left untraced, and a member of the real
tiny llama loaded lazily holding, at MLX's peak, no more than its share. tests/test_tensor_parallel.py holds
every architecture's lazily read member equal, bit for bit, to a whole load then the cut, and its two-process
members' peaks to their shares."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.nn.layers.distributed import shard_linear
from mlx.utils import tree_flatten

from stage_worker.checkpoint.gguf.format import read_gguf_part
from stage_worker.checkpoint.safetensors_format import part_nbytes, read_part, runs_of, stored_tensors
from stage_worker.parallel.share_reads import Kept, trace_cut
from tests.test_tensor_parallel import _Member  # a group's size and rank, as a cut asks them


def _saved(tmp_path, arrays: dict[str, mx.array]) -> str:
    path = str(tmp_path / "t.safetensors")
    mx.save_safetensors(path, arrays)
    return path


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16, mx.uint32])
def test_a_part_read_alone_is_numpys_cut_of_the_whole(tmp_path, dtype):
    whole = {"a": (mx.random.normal((6, 10)) * 100).astype(dtype), "b": mx.arange(2 * 3 * 8).reshape(2, 3, 8),
             "c": mx.random.normal((5,))}
    path = _saved(tmp_path, whole)
    stored = stored_tensors(path)
    loaded = mx.load(path)
    assert {n: t.shape for n, t in stored.items()} == {n: tuple(a.shape) for n, a in whole.items()}
    cuts = {"a": [((range(2, 5),), (range(0, 10),)),  # rows
                  ((range(0, 6),), (range(3, 7),)),  # columns
                  ((range(0, 1), range(4, 6)), (range(0, 2), range(5, 9)))],  # runs on both axes
            "b": [((range(1, 2),), (range(0, 3),), (range(4, 8),))], "c": [((range(1, 4),),)]}
    for name, keeps in cuts.items():
        reference = np.array(loaded[name].astype(mx.float32))
        for keep in keeps:
            part = read_part(stored[name], keep)
            assert part.dtype == whole[name].dtype and part.nbytes == part_nbytes(stored[name], keep)
            index = np.ix_(*[np.concatenate([np.arange(r.start, r.stop) for r in runs]) for runs in keep])
            assert np.array_equal(np.array(part.astype(mx.float32)), reference[index]), (name, keep)


def test_runs_a_part_cannot_take_are_refused(tmp_path):
    stored = stored_tensors(_saved(tmp_path, {"a": mx.zeros((4, 4))}))["a"]
    with pytest.raises(ValueError, match="do not fit"):
        read_part(stored, ((range(0, 5),), (range(0, 4),)))
    with pytest.raises(ValueError, match="do not fit"):
        read_part(stored, ((range(0, 4),),))
    assert runs_of([0, 1, 2, 5, 6, 9]) == (range(0, 3), range(5, 7), range(9, 10))
    with pytest.raises(ValueError):
        runs_of([3, 1])


def test_mlx_cuts_are_traced_to_the_rows_and_columns_they_keep():
    model = nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 8), nn.LayerNorm(8))
    mx.eval(model.parameters())
    before = dict(tree_flatten(model.parameters()))

    def cut(m: nn.Module) -> None:
        m.layers[0] = shard_linear(m.layers[0], "all-to-sharded", group=_Member(2, 1))
        m.layers[1] = shard_linear(m.layers[1], "sharded-to-all", group=_Member(2, 1))

    kept = trace_cut(model, cut)
    assert dict(tree_flatten(model.parameters())).keys() == before.keys()  # the model itself is left as it was
    assert kept == {
        "layers.0.weight": Kept("layers.0.weight", ((range(3, 6),), (range(0, 8),)), mx.float32),
        "layers.0.bias": Kept("layers.0.bias", ((range(3, 6),),), mx.float32),
        "layers.1.weight": Kept("layers.1.weight", ((range(0, 8),), (range(3, 6),)), mx.float32),
    }  # layers.1's bias and the norm are untouched by the cut: read whole, as loaded


def test_a_cut_that_computes_on_a_parameter_is_not_traced():
    model = nn.Sequential(nn.Linear(4, 4))

    def cut(m: nn.Module) -> None:
        m.layers[0].weight = mx.contiguous(m.layers[0].weight[:2])
        m.layers[0].bias = m.layers[0].bias / 2  # gpt-oss's experts' bias, divided by the group's size

    assert set(trace_cut(model, cut)) == {"layers.0.weight"}


def test_a_lazily_loaded_member_holds_no_more_than_its_share_at_mlxs_peak(tmp_path):
    from stage_worker.checkpoint.model_reader import read_model_spec
    from stage_worker.model.stage_model import StageModel, StageRole
    from stagemesh_core.layer_split import LayerRange
    from tests.architectures import tiny_checkpoint

    spec = read_model_spec(tiny_checkpoint("llama", tmp_path))
    model = StageModel.load(spec, StageRole(LayerRange(0, spec.num_layers), True, True), mx.float32,
                            evaluate=False)
    whole_layers = model.layer_bytes
    assert model.sources  # every tensor lies in the files
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    model.shard(_Member(2, 1), rank_0_extra=spec.vocab_size * spec.hidden_size)
    held = mx.get_active_memory() - base
    assert model.layer_bytes < 0.7 * whole_layers  # worker 1: more of the MLP, since worker 0 holds the head
    # Read whole and cut a layer at a time, the peak would hold one whole layer beyond the share.
    largest_layer = whole_layers // spec.num_layers
    assert mx.get_peak_memory() - base - held < 0.05 * largest_layer, (mx.get_peak_memory() - base, held)


@pytest.mark.e2e  # reads the real model
def test_a_gguf_part_is_the_whole_conversions_cut_on_any_rows_and_columns():
    # The default model's Q4_1 blocks (32 elements) and its q/k rows permuted per head by llama.cpp: parts that
    # end inside a block or a head are widened to whole ones, converted, un-permuted, and cut back to the run.
    from stage_worker.checkpoint.default_model import default_model_path
    from stage_worker.checkpoint.gguf.format import load_gguf_weights
    from stage_worker.checkpoint.model_reader import read_model_spec

    spec = read_model_spec(default_model_path())
    converted = load_gguf_weights(spec, range(0, 1), False, False)
    sources: dict = {}
    placeholders = load_gguf_weights(spec, range(0, 1), False, False, evaluate=False, sources=sources)
    assert placeholders.keys() == converted.keys() == sources.keys()
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.mlp.down_proj"):
        for suffix in ("weight", "scales", "biases"):
            whole = converted[f"{name}.{suffix}"]
            source = sources[f"{name}.{suffix}"]
            assert (source.shape, source.dtype) == (tuple(whole.shape), whole.dtype)
            rows, columns = whole.shape
            keep = ((range(3, 70), range(100, rows)), (range(1, columns // 3), range(columns // 2, columns - 1)))
            index = np.ix_(*[np.concatenate([np.arange(r.start, r.stop) for r in runs]) for runs in keep])
            expected = np.array(whole)[index]
            assert np.array_equal(np.array(read_gguf_part(source, keep)), expected), (name, suffix)
