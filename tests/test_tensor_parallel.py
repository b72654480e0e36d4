"""Tensor parallelism's compute: a layer's split decided, each architecture's cut (``SHARDERS``) summing
to the whole layer, the counts a cut cannot divide refused, and a real two-process MLX ring group decoding the
default model and each layer-stack architecture with the greedy tokens of one whole process
(``stage_worker.parallel.tensor_parallel``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from stage_worker.checkpoint.model_spec import ModelSpec
from stage_worker.model.blas import blas_environment, find_optimized_blas
from stage_worker.model.stage_model import check_shardable
from stage_worker.parallel.tensor_parallel import (
    SHARDERS,
    divided_counts,
    even_share,
    linear_attention_heads,
    split_layer,
)
from stagemesh_core.errors import UserError
from tests.conftest import free_port_base

ROOT = Path(__file__).resolve().parent.parent
STEPS = 48
# Chat-formatted prompt ids are not needed: any token ids drive the same layers.
PROMPTS = [[1, 504, 3458, 282, 4649, 314, 253], [1, 18985, 2377, 28, 2476, 279, 957, 30, 2056, 1078]]


def test_a_share_is_whole_kv_groups_as_even_as_the_counts_allow():
    # SmolLM2-135M: 9 heads over 3 KV heads, 1536 intermediate features.
    first, second = (split_layer(9, 3, 1536, 2, rank) for rank in (0, 1))
    assert (first.kv_heads, first.heads, first.intermediate) == (range(0, 2), range(0, 6), range(0, 768))
    assert (second.kv_heads, second.heads, second.intermediate) == (range(2, 3), range(6, 9), range(768, 1536))
    thirds = [split_layer(32, 8, 11008, 4, rank) for rank in range(4)]
    assert [len(s.heads) for s in thirds] == [8] * 4 and sum(len(s.intermediate) for s in thirds) == 11008


@pytest.mark.parametrize("counts, size, names", [((9, 3, 1536), 4, "-tp 3 or less"),
                                                 ((8, 8, 2), 4, "intermediate size 2"),
                                                 ((9, 2, 64), 2, "do not divide")])
def test_a_split_the_model_cannot_take_names_what_would(counts, size, names):
    with pytest.raises(UserError, match=names):
        split_layer(*counts, size, 0)


def _decode(tmp_path: Path, size: int, model: str | None = None) -> dict:
    config = {"size": size, "prompts": PROMPTS, "steps": STEPS, "out": str(tmp_path / f"tp{size}.json"),
              "model": model}
    (tmp_path / f"tp{size}-config.json").write_text(json.dumps(config))
    hostfile = tmp_path / "hosts.json"
    base = free_port_base(size)
    hostfile.write_text(json.dumps([[f"127.0.0.1:{base + rank}"] for rank in range(size)]))
    command = [sys.executable, "-m", "tests.tensor_parallel_worker", str(tmp_path / f"tp{size}-config.json")]
    # On the BLAS a stage preloads, one thread each: the reference BLAS MLX links takes 4x as long a step.
    env = blas_environment(os.environ, find_optimized_blas(), threads=1)
    procs = [subprocess.Popen(command,
                              cwd=ROOT, env={**env, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile),
                                             "OMP_NUM_THREADS": "1"},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(size)]
    try:
        outputs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(outputs)
    result = json.loads(Path(config["out"]).read_text())
    result["logits"] = np.load(config["out"] + ".logits.npy")
    return result


def _never_held_the_whole_stage(member: dict, bound: float) -> None:
    """A member loads lazily and reads each cut tensor's part alone (``share_reads``), from safetensors and from
    a GGUF's blocks: beyond the share it keeps, MLX's peak over the load and the cut holds a sliver of what it
    drops (the default model's: the moment its embedding is made dense). Read whole and cut a layer at a
    time, the excess was one layer's tensors: half or more of what a tiny model drops, a tenth of the default
    model's. Loaded whole and then cut, the excess is all it drops."""
    dropped = member["whole_bytes"] - member["weight_bytes"]
    excess = member["load_peak_bytes"] - member["weight_bytes"]
    assert excess < bound * dropped, member


@pytest.mark.e2e
def test_two_workers_decode_the_default_model_with_one_workers_greedy_tokens(tmp_path):
    whole, pair = _decode(tmp_path, 1), _decode(tmp_path, 2)
    assert (pair["heads"], pair["kv_heads"]) == (6, 2)  # rank 0 holds two of the three KV groups
    for one, two in zip(whole["results"], pair["results"]):
        assert one["tokens"] == two["tokens"]
    # The group sums partial products in another order than one matmul: equal to float32 rounding.
    worst = float(np.abs(whole["logits"] - pair["logits"]).max())
    assert worst < 1e-2, worst
    # Rank 0 holds 6 of 9 heads' and half the MLP's weights; embedding and head stay whole.
    assert pair["weight_bytes"] < whole["weight_bytes"]
    # Measured 2026-12-07: 4.8 of the 268 MB dropped (one layer's whole tensors, 24 MB, when cut whole).
    _never_held_the_whole_stage(pair, bound=0.05)


@pytest.mark.e2e
@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss", "qwen3_next", "gemma3_text", "mixtral"])
def test_two_workers_decode_each_architecture_with_one_workers_greedy_tokens(tmp_path, name):
    # The packed path (our own cut) is the default model's test above. On the layer stack, qwen3_moe's experts
    # and gpt_oss's sinks and windows are cut by mlx-lm's own shard(); qwen3_next's linear attention and
    # shared expert, gemma3_text's windows and mixtral's experts by tensor_parallel's own cuts (SHARDERS).
    from tests.architectures import TINY_CONFIGS, tiny_checkpoint

    path = tiny_checkpoint(name, tmp_path)
    whole, pair = _decode(tmp_path, 1, path), _decode(tmp_path, 2, path)
    assert pair["kv_heads"] == 1 and pair["heads"] == 2
    for one, two in zip(whole["results"], pair["results"]):
        # Not bit-equal: the group sums two partial products where one process sums one dot product, another
        # order of float32 additions. The tokens are the same over every step, the logits equal to its rounding.
        assert one["tokens"] == two["tokens"]
    worst = float(np.abs(whole["logits"] - pair["logits"]).max())
    assert worst < 1e-3, worst
    # Every layer's weights but its norms and routers are cut in two: a worker's layers hold about half.
    assert 0.49 < pair["layer_bytes"] / whole["layer_bytes"] < 0.52, (pair["layer_bytes"], whole["layer_bytes"])
    assert pair["weight_bytes"] < whole["weight_bytes"]
    _never_held_the_whole_stage(pair, bound=0.02)  # measured 2026-12-07: 8 to 12 bytes beyond the share
    # Each cache holds the worker's heads only: every cached array's head (or channel) axis halves.
    config = TINY_CONFIGS[name]
    for shapes_one, shapes_two in zip(whole["cache_shapes"], pair["cache_shapes"]):
        for one, two in zip(shapes_one, shapes_two):
            halved = [i for i, (a, b) in enumerate(zip(one, two)) if a != b]
            assert len(halved) == 1 and one[halved[0]] == 2 * two[halved[0]], (name, one, two)
    assert len(whole["cache_shapes"]) == config["num_hidden_layers"]


def test_an_even_split_names_the_sizes_that_divide():
    args = {"num_attention_heads": 12, "num_key_value_heads": 4, "intermediate_size": 96,
            "moe_intermediate_size": 8}
    assert even_share(args, 2, 1).kv_heads == range(2, 4)
    with pytest.raises(UserError, match=r"-tp 3 does not divide the model's 4 KV heads, 8 experts' intermediate size; "
                                        r"-tp 1 or 2 or 4 would"):
        even_share(args, 3, 0)


def test_a_linear_attention_share_is_whole_key_head_groups():
    # Qwen3-Next-80B: 16 key heads, 32 value heads (two per key head).
    share = linear_attention_heads(16, 32, 4, 1)
    assert (share.key_heads, share.value_heads) == (range(4, 8), range(8, 16))
    assert linear_attention_heads(2, 4, 2, 1).value_heads == range(2, 4)
    with pytest.raises(UserError, match="does not divide the model's 2 linear-attention key heads"):
        linear_attention_heads(2, 4, 4, 0)


def test_the_counts_each_cut_divides():
    from tests.architectures import TINY_CONFIGS

    next_counts = divided_counts("qwen3_next", TINY_CONFIGS["qwen3_next"])
    assert next_counts == {"attention heads": 4, "KV heads": 2, "linear-attention key heads": 2,
                           "linear-attention value heads": 4, "experts' intermediate size": 32,
                           "shared expert's intermediate size": 32}  # every layer has experts: no dense MLP
    assert divided_counts("qwen3_next", {**TINY_CONFIGS["qwen3_next"], "mlp_only_layers": [0]})[
        "intermediate size"] == 128
    assert divided_counts("mixtral", TINY_CONFIGS["mixtral"]) == {
        "attention heads": 4, "KV heads": 2, "experts' intermediate size": 64}
    assert divided_counts("gemma3_text", TINY_CONFIGS["gemma3_text"]) == {
        "attention heads": 4, "KV heads": 2, "intermediate size": 128}
    assert divided_counts("qwen3_moe", TINY_CONFIGS["qwen3_moe"]) == {
        "attention heads": 4, "KV heads": 2, "intermediate size": 128, "experts' intermediate size": 32}


def _spec(name: str, **changes: object) -> ModelSpec:
    from tests.architectures import TINY_CONFIGS

    args = {**TINY_CONFIGS[name], **changes}
    return ModelSpec(path="/nonexistent", format="mlx", model_type=args["model_type"], args=args,
                     num_layers=args["num_hidden_layers"], hidden_size=args["hidden_size"],
                     vocab_size=args["vocab_size"], tie_word_embeddings=bool(args.get("tie_word_embeddings")),
                     quantization=None, default_served_name=name)


@pytest.mark.parametrize("name, changes, size, message", [
    ("qwen3_next", {}, 4, r"-tp 4 does not divide the model's 2 KV heads, 2 linear-attention key heads; "
                          r"-tp 1 or 2 would"),
    ("qwen3_next", {"linear_num_value_heads": 6, "linear_num_key_heads": 3}, 2,
     r"-tp 2 does not divide the model's 3 linear-attention key heads; -tp 1 would"),
    ("qwen3_next", {"shared_expert_intermediate_size": 33}, 2, r"the model's 33 shared expert's intermediate size; "
                                                               r"-tp 1 would"),
    ("gemma3_text", {"intermediate_size": 90}, 4, r"2 KV heads, 90 intermediate size; -tp 1 or 2 would"),
    ("gemma3_text", {"num_attention_heads": 6, "num_key_value_heads": 3, "intermediate_size": 96}, 2,
     r"-tp 2 does not divide the model's 3 KV heads; -tp 1 or 3 would"),
    ("mixtral", {"intermediate_size": 42}, 4, r"2 KV heads, 42 experts' intermediate size; -tp 1 or 2 would"),
    ("phi3", {}, 2, r"no tensor-parallel sharding for phi3 .*-pp"),
])
def test_check_shardable_refuses_counts_the_cut_cannot_divide(name, changes, size, message):
    spec = _spec(name, **changes)
    with pytest.raises(UserError, match=message):
        check_shardable(spec, size)
    check_shardable(_spec(name), 1)


def test_check_shardable_takes_the_counts_that_divide():
    for name in ("qwen3_next", "gemma3_text", "mixtral", "qwen3_moe", "gpt_oss"):
        check_shardable(_spec(name), 2)


class _Member:
    """Member ``rank`` of a group of ``size``, in this one process: enough for mlx's cut, which asks only the
    size and rank (the group's sums are replaced in the test below)."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def _tiny_model(name: str, quantized: bool):
    import importlib

    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from tests.architectures import TINY_CONFIGS

    arch = importlib.import_module(f"mlx_lm.models.{name}")
    args = arch.ModelArgs.from_dict({**TINY_CONFIGS[name], "vocab_size": 128})
    mx.random.seed(sum(map(ord, name)))
    whole = arch.Model(args)
    if quantized:
        nn.quantize(whole, group_size=32, bits=8)
    mx.eval(whole.parameters())

    def copy():
        model = arch.Model(args)
        if quantized:
            nn.quantize(model, group_size=32, bits=8)
        model.load_weights(tree_flatten(whole.parameters()))
        return model

    return whole, copy


def _sublayers(name: str, layer):
    """A layer's attention (with a fresh cache of its kind) and its MLP, each as ``f(x) -> (out, cache)``."""
    from mlx_lm.models.cache import ArraysCache, KVCache

    if name == "qwen3_next" and layer.is_linear:
        def mixer(x):
            cache = ArraysCache(size=2)
            return layer.linear_attn(x, None, cache), cache
    else:
        def mixer(x):
            cache = KVCache()
            return layer.self_attn(x, None, cache), cache
    mlp = layer.block_sparse_moe if name == "mixtral" else layer.mlp
    return [mixer, lambda x: (mlp(x), None)]


@pytest.mark.parametrize("name, quantized", [("qwen3_next", False), ("gemma3_text", False), ("mixtral", False),
                                             ("gemma3_text", True), ("mixtral", True)])
def test_each_members_part_sums_to_the_whole_layer(monkeypatch, name, quantized):
    # Every attention (full, sliding or linear) and every MLP or expert block of a cut layer: the members'
    # outputs before the group's sum add up to the whole layer's, each sums once over the group, and each
    # member's cache holds half the heads.
    import mlx.core as mx

    from tests.tensor_parallel_worker import cached_arrays

    whole, copy = _tiny_model(name, quantized)
    members = []
    for rank in range(2):
        model = copy()
        SHARDERS[name](model, _Member(2, rank))
        members.append(model)
    sums = []

    def own_part(x, group=None, stream=None):  # the group's sum replaced by a member's own part, counted
        sums.append(group)
        return x

    monkeypatch.setattr(mx.distributed, "all_sum", own_part)
    x = mx.random.normal((1, 5, 64), key=mx.random.key(7))
    for index, layer in enumerate(whole.model.layers):
        parts = [_sublayers(name, member.model.layers[index]) for member in members]
        for which, run in enumerate(_sublayers(name, layer)):
            out, cache = run(x)
            sums.clear()
            halves = [part[which](x) for part in parts]
            assert len(sums) == 2, (index, which, len(sums))  # one all-reduce per attention or MLP, per member
            total = halves[0][0] + halves[1][0]
            assert mx.allclose(out, total, atol=1e-4 if quantized else 1e-5).item(), (index, which)
            if cache is not None:
                arrays = [cached_arrays(c.state) for c in (cache, halves[0][1])]
                assert arrays[0] and len(arrays[0]) == len(arrays[1])
                for one, half in zip(*arrays):
                    axis = next(i for i, (a, b) in enumerate(zip(one.shape, half.shape)) if a != b)
                    assert one.shape[axis] == 2 * half.shape[axis], (one.shape, half.shape)


def test_a_cut_that_splits_a_quantization_group_is_refused():
    # Experts of 32 intermediate features in groups of 32: two members cannot each hold whole groups.
    whole, copy = _tiny_model("qwen3_next", quantized=True)
    with pytest.raises(UserError, match="splits a quantization group of 32"):
        SHARDERS["qwen3_next"](copy(), _Member(2, 0))


def test_a_members_kv_is_its_kv_heads_part_or_the_whole_latent():
    from stage_worker.parallel.tensor_parallel import kv_part_held
    from stagemesh_core.memory import StageKV

    share = even_share({"num_attention_heads": 8, "num_key_value_heads": 4, "intermediate_size": 64}, 2, 1)
    assert kv_part_held("qwen3_next", {"num_attention_heads": 8, "num_key_value_heads": 4}, share) == (2, 4)
    assert kv_part_held("deepseek_v3", {"num_attention_heads": 8, "num_key_value_heads": 8}, share) == (1, 1)
    kv = StageKV(per_token=512, windows=((256, 128),))
    assert kv.share(*kv_part_held("gemma3_text", {"num_attention_heads": 8, "num_key_value_heads": 4}, share)) \
        == StageKV(per_token=256, windows=((128, 128),))


@pytest.mark.parametrize("name, load_format, quantization, dense", [
    ("llama", "auto", None, False),  # the packed path, read from its file
    ("llama", "auto", "affine8", True),  # quantized, dequantized as it is cut
    ("qwen3_moe", "auto", None, False),  # the layer stack: mlx-lm's own shard()
    ("qwen3_next", "dummy", None, False),  # random weights made as they are cut; our own cut
    ("gpt_oss", "auto", None, False),  # sinks and windows, mlx-lm's own shard()
    ("mixtral", "auto", "affine8", True),  # experts dequantized as they are cut, our own cut
    # GGUFs as llama.cpp writes them: blocks read for the member's rows and columns alone (placeholders until
    # then): Q8_0 kept quantized (codes, scales, biases each cut), Gemma's shifted norms in F16, experts dequantized.
    ("gguf-gemma3", "auto", "Q8_0", False),
    ("gguf-gemma3", "auto", "F16", False),
    ("gguf-qwen3moe", "auto", "Q8_0", True),
    # The default model's GGUF (Q4_1, q/k rows permuted per head), dequantized as it is cut (the real model).
    pytest.param("default", "auto", None, True, marks=pytest.mark.e2e),
])
def test_a_lazily_loaded_member_holds_exactly_what_a_whole_load_then_cut_holds(tmp_path, name, load_format,
                                                                               quantization, dense):
    # A group's worker loads without evaluating and cuts before anything is read (stage_process.load); what it
    # ends with must be the very arrays a whole load and then the cut gives, in every layer and at the ends.
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from stage_worker.checkpoint.default_model import default_model_path
    from stage_worker.checkpoint.model_reader import read_model_spec
    from stage_worker.model.stage_model import StageModel, StageRole
    from stagemesh_core.layer_split import LayerRange
    from tests.architectures import tiny_checkpoint

    if name == "default":
        path = default_model_path()
    elif name.startswith("gguf-"):
        from gguf import GGMLQuantizationType

        from stagemesh.bench.random_checkpoint import write_random_checkpoint
        from tests.llama_cpp_gguf import convert_checkpoint
        from tests.test_gguf_architectures import CONFIGS

        arch = name.removeprefix("gguf-")
        write_random_checkpoint(CONFIGS[arch], tmp_path / "mlx", dtype="float32", seed=5)
        path = str(tmp_path / f"{arch}.gguf")
        convert_checkpoint(tmp_path / "mlx", arch, GGMLQuantizationType[quantization], Path(path))
    else:
        path = tiny_checkpoint(name, tmp_path, quantization=quantization)
    spec = read_model_spec(path, load_format=load_format)
    role = StageRole(LayerRange(0, spec.num_layers), True, True)
    for rank in range(2):
        held = []
        for evaluate in (True, False):
            mx.random.seed(3)  # dummy weights: the same random draws either way
            model = StageModel.load(spec, role, mx.float32, evaluate=evaluate)
            if dense:
                model.dequantize(evaluate=evaluate)
            model.shard(_Member(2, rank), rank_0_extra=spec.vocab_size * spec.hidden_size)
            held.append(dict(tree_flatten(model._module.parameters())))
        eager, lazy = held
        assert eager.keys() == lazy.keys()
        for key, array in eager.items():
            assert array.dtype == lazy[key].dtype and mx.array_equal(array, lazy[key]).item(), (name, rank, key)


def test_mlx_lms_cut_that_would_split_a_quantization_group_is_refused_naming_the_way_out(tmp_path):
    import mlx.core as mx

    from stage_worker.checkpoint.model_reader import read_model_spec
    from stage_worker.model.stage_model import StageModel, StageRole
    from stagemesh_core.layer_split import LayerRange
    from tests.architectures import tiny_checkpoint

    # gpt_oss's 64-feature projections in groups of 64: a half is 32 features, not one whole group.
    spec = read_model_spec(tiny_checkpoint("gpt_oss", tmp_path, quantization="affine8"))
    model = StageModel.load(spec, StageRole(LayerRange(0, spec.num_layers), True, True), mx.float32,
                            evaluate=False)
    with pytest.raises(UserError, match=r"-tp 2 cannot cut gpt_oss's quantized weights: .*--dequantize on"):
        model.shard(_Member(2, 0))
