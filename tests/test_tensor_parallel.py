"""Tensor parallelism's compute: a layer's split decided, and a real two-process MLX ring group decoding the
default model with the greedy tokens of one whole process (``stage_worker.model.tensor_parallel``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stage_worker.model.tensor_parallel import even_share, split_layer
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
    procs = [subprocess.Popen(command,
                              cwd=ROOT, env={**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile),
                                             "OMP_NUM_THREADS": "1"},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(size)]
    try:
        outputs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(outputs)
    return json.loads(Path(config["out"]).read_text())


@pytest.mark.e2e
def test_two_workers_decode_the_default_model_with_one_workers_greedy_tokens(tmp_path):
    whole, pair = _decode(tmp_path, 1), _decode(tmp_path, 2)
    assert (pair["heads"], pair["kv_heads"]) == (6, 2)  # rank 0 holds two of the three KV groups
    for one, two in zip(whole["results"], pair["results"]):
        assert one["tokens"] == two["tokens"]
        # The group sums partial products in another order than one matmul: equal to float32 rounding.
        worst = max(abs(a - b) for la, lb in zip(one["logits"], two["logits"]) for a, b in zip(la, lb))
        assert worst < 1e-2, worst
    # Rank 0 holds 6 of 9 heads' and half the MLP's weights; embedding and head stay whole.
    assert pair["weight_bytes"] < whole["weight_bytes"]


@pytest.mark.e2e
@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss", "qwen3_next", "gemma3_text", "mixtral"])
def test_two_workers_decode_each_architecture_with_one_workers_greedy_tokens(tmp_path, name):
    # The packed path (our own cut) is the default model's test above. On the layer stack, qwen3_moe's experts
    # and gpt_oss's sinks and windows are cut by mlx-lm's own shard(); qwen3_next's linear attention and
    # shared expert, gemma3_text's windows and mixtral's experts by arch_sharding's cuts.
    from tests.architectures import TINY_CONFIGS, tiny_checkpoint

    path = tiny_checkpoint(name, tmp_path)
    whole, pair = _decode(tmp_path, 1, path), _decode(tmp_path, 2, path)
    assert pair["kv_heads"] == 1 and pair["heads"] == 2
    for one, two in zip(whole["results"], pair["results"]):
        # Not bit-equal: the group sums two partial products where one process sums one dot product, another
        # order of float32 additions. The tokens are the same over every step, the logits equal to its rounding.
        assert one["tokens"] == two["tokens"]
        worst = max(abs(a - b) for la, lb in zip(one["logits"], two["logits"]) for a, b in zip(la, lb))
        assert worst < 1e-3, worst
    # Every layer's weights but its norms and routers are cut in two: a worker's layers hold about half.
    assert 0.49 < pair["layer_bytes"] / whole["layer_bytes"] < 0.52, (pair["layer_bytes"], whole["layer_bytes"])
    assert pair["weight_bytes"] < whole["weight_bytes"]
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
