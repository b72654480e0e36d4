"""Expert blocks run as every expert on every row compute what mlx-lm's gathered experts compute.

``stage_worker.model.expert_routing``: the all-experts form of a ``SwitchGLU`` against mlx-lm's own call on the same
block (plain SwiGLU, and gpt-oss's clamped activation with biases), row counts on both sides of the policy's
limit, the policy's setting, and the MoE architectures of the suite served at PP=2 with every expert block
routed, batched, equal to mlx-lm's greedy generation.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.gpt_oss import SwigluOAI
from mlx_lm.models.switch_layers import SwitchGLU

from stage_worker.checkpoint.model_reader import read_model_spec
from stage_worker.model.expert_routing import (
    CUDA_ALL_EXPERTS_MAX_ROWS,
    GATHERED,
    SORTED_PAIRS,
    ExpertsPolicy,
    RoutedSwitchGLU,
    all_experts_glu,
    policy_for,
)
from stage_worker.model.stage_model import StageModel, StageRole
from stagemesh_core.layer_split import LayerRange, even_split
from tests.architectures import mlx_lm_greedy, tiny_checkpoint
from tests.engine_helpers import InProcessPipeline, read_until_finished


def _block(activation, bias: bool) -> SwitchGLU:
    mx.random.seed(3)
    block = SwitchGLU(32, 48, 8, bias=bias, **({"activation": activation} if activation else {}))
    if bias:
        for linear in (block.gate_proj, block.up_proj, block.down_proj):
            linear.bias = mx.random.normal(linear.bias.shape)
    return block


def _picks(lead: tuple[int, ...], experts: int, k: int) -> mx.array:
    return mx.argpartition(mx.random.uniform(shape=(*lead, experts)), kth=experts - k, axis=-1)[..., experts - k:]


@pytest.mark.parametrize("activation,bias", [(None, False), (SwigluOAI(), True)], ids=["swiglu", "gpt_oss"])
@pytest.mark.parametrize("lead", [(1, 1), (5, 1), (2, 7), (1, 70)])
def test_all_experts_equal_the_gathered_experts(activation, bias, lead):
    block = _block(activation, bias)
    x = mx.random.normal((*lead, 32))
    indices = _picks(lead, 8, 3)
    gathered = block(x, indices)
    every = all_experts_glu(block, x, indices)
    assert every.shape == gathered.shape == (*lead, 3, 32)
    # The same dot products; an optimized BLAS may block the wider matrices differently (last bits only).
    assert mx.allclose(every, gathered, rtol=1e-5, atol=1e-5).item()


def test_a_routed_block_runs_every_expert_only_up_to_its_row_limit(monkeypatch):
    block = _block(None, False)
    block.__class__ = RoutedSwitchGLU
    block._experts_policy = ExpertsPolicy(all_experts_max_rows=40)
    calls: list[int] = []
    import stage_worker.model.expert_routing as routing

    real = routing.all_experts_glu
    monkeypatch.setattr(routing, "all_experts_glu", lambda b, x, i: calls.append(x.shape[0]) or real(b, x, i))
    # Two experts a row: from 32 rows the pairs are sorted by mlx-lm (SORTED_PAIRS), the rows' limit is 40.
    for rows in (1, 31, 32, 40, 41, 90):
        block(mx.random.normal((rows, 1, 32)), _picks((rows, 1), 8, 2))
    assert SORTED_PAIRS == 64 and calls == [32, 40]


def test_the_setting_decides_the_policy():
    assert policy_for("auto", "cuda") == ExpertsPolicy(CUDA_ALL_EXPERTS_MAX_ROWS)
    assert policy_for("auto", "cpu") == GATHERED and policy_for("auto", "metal") == GATHERED
    assert policy_for("off", "cuda") == GATHERED
    assert policy_for("0", "cuda") == GATHERED
    assert policy_for("24", "cpu") == ExpertsPolicy(24)
    for bad in ("-1", "many", "1.5"):
        with pytest.raises(ValueError, match="STAGEMESH_ALL_EXPERTS_ROWS must be auto, off or a row count"):
            policy_for(bad, "cuda")


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_routed_moe_models_equal_mlx_lm_generation(tmp_path, monkeypatch, name):
    from mlx_lm.utils import load

    path = tiny_checkpoint(name, tmp_path)
    spec = read_model_spec(path)
    prompts = [(504, 3575, 282, 4649, 314, 1018, 28, 2270, 253, 11, 12, 13), (1, 2, 3), (17, 42, 99, 1000, 5)]
    expected = mlx_lm_greedy(load(path)[0], prompts, 8)
    stages = []
    for i, r in enumerate(even_split(spec.num_layers, 2)):
        stage = StageModel.load(spec, StageRole(LayerRange(r.start, r.end), i == 0, i == 1), mx.float32)
        names = [n for n, _ in tree_flatten(stage._module.parameters())]
        # Every call routed through all experts: prompts (several rows) and decode steps alike.
        assert stage.route_experts(ExpertsPolicy(all_experts_max_rows=1 << 20, all_experts_min_pairs=1)) > 0
        assert [n for n, _ in tree_flatten(stage._module.parameters())] == names
        stages.append(stage)
    calls = []
    import stage_worker.model.expert_routing as routing

    real = routing.all_experts_glu
    monkeypatch.setattr(routing, "all_experts_glu", lambda b, x, i: calls.append(x.shape) or real(b, x, i))
    with InProcessPipeline(stages) as pipeline:
        outputs, _ = read_until_finished([pipeline.submit(p, 8) for p in prompts])
    assert outputs == expected
    assert calls and any(shape[0] > 1 for shape in calls)  # prompts and batched decode steps ran every expert


def test_quantized_experts_stay_gathered(tmp_path):
    path = tiny_checkpoint("qwen3_moe", tmp_path, quantization="affine4")
    spec = read_model_spec(path)
    stage = StageModel.load(spec, StageRole(LayerRange(0, spec.num_layers), True, True), mx.float32)
    assert stage.quantized
    assert stage.route_experts(ExpertsPolicy(64)) == 0
