"""One GPU per stage on a node with several: how a node counts them, which one each stage gets, and
how a stage narrows CUDA_VISIBLE_DEVICES to it before MLX loads."""

import pytest

from coordinator.config import MeshConfig, stage_options
from coordinator.placement import assign_gpus
from stage_worker.service.process_setup import gpu_environment
from stagemesh_core import settings
from stagemesh_core.errors import UserError
from stagemesh_core.gpus import (
    APPLIED_MARK,
    count_listed_gpus,
    node_gpu_count,
    stage_gpu_environment,
    stage_has_own_gpu,
    visible_devices,
)
from stagemesh_core.layer_split import LayerRange
from stagemesh_core.plan import PipelinePlan, StageLaunch, StageOptions, StagePlacement

SMI_L = """GPU 0: NVIDIA H200 (UUID: GPU-aaaa)
GPU 1: NVIDIA H200 (UUID: GPU-bbbb)
  MIG 1g.18gb     Device  0: (UUID: MIG-cccc)
GPU 2: NVIDIA H200 (UUID: GPU-dddd)
"""


def test_cuda_visible_devices_is_read_as_cuda_reads_it():
    assert visible_devices({}) is None
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "2, 3"}) == ["2", "3"]
    assert visible_devices({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "0,-1,1"}) == ["0"]  # CUDA stops at an invalid entry
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "GPU-aaaa,GPU-bbbb"}) == ["GPU-aaaa", "GPU-bbbb"]


def test_a_node_counts_its_visible_gpus_else_nvidia_smis():
    assert count_listed_gpus(SMI_L) == 3 and count_listed_gpus(None) == 0
    assert node_gpu_count({}, SMI_L) == 3
    assert node_gpu_count({"CUDA_VISIBLE_DEVICES": "4,5"}, SMI_L) == 2
    assert node_gpu_count({}, None) == 0  # a Mac or a CPU node: nothing to assign


def test_stages_take_their_nodes_gpus_round_robin():
    nodes = ["a", "a", "b", "a", "a", "a", "c"]
    assert assign_gpus(nodes, {"a": 4, "b": 2, "c": 0}) == [0, 1, 0, 2, 3, 0, None]
    assert assign_gpus(["a", "a", "a"], {"a": 1}) == [0, 0, 0]
    assert assign_gpus(["m"], {}) == [None]


def test_a_restarted_replica_avoids_gpus_other_replicas_keep():
    # replica 1 holds GPUs 0 and 1 of node a; replica 0 starts again with two stages there
    assert assign_gpus(["a", "a"], {"a": 4}, held=[("a", 0), ("a", 1)]) == [2, 3]
    assert assign_gpus(["a", "a"], {"a": 2}, held=[("a", 0)]) == [1, 0]


def test_stage_options_carry_the_gpu_and_its_sharers():
    config = MeshConfig(model_path="/m", served_model_name="m", num_layers=2)
    options = stage_options(config, "node", stages_on_node=4, gpu_index=1, stages_on_gpu=2)
    assert (options.gpu_index, options.stages_on_gpu, options.stages_on_host) == (1, 2, 4)
    assert stage_options(config, "node", 2, None, 3).stages_on_gpu == 0
    with pytest.raises(UserError, match="gpu_index must not be negative"):
        StageOptions(gpu_index=-1)


def _launch(options: StageOptions) -> StageLaunch:
    stage = StagePlacement(rank=0, global_index=0, layers=LayerRange(0, 1), host="h", ring_port=30000,
                           lane_port=30001, grpc_port=30002)
    return StageLaunch(PipelinePlan(replica=0, model_path="/m", num_layers=1, compute_dtype="auto",
                                    stages=(stage,)), 0, options)


def test_a_stage_narrows_cuda_visible_devices_to_its_gpu():
    launch = _launch(StageOptions(gpu_index=1))
    assert gpu_environment(launch, {}) == {"CUDA_VISIBLE_DEVICES": "1", APPLIED_MARK: "1"}
    assert gpu_environment(launch, {"CUDA_VISIBLE_DEVICES": "4,6"})["CUDA_VISIBLE_DEVICES"] == "6"
    assert gpu_environment(launch, {"STAGEMESH_GPU_PER_STAGE": "off"}) == {}
    assert gpu_environment(_launch(StageOptions()), {}) == {}  # no GPU assigned: the node's environment
    assert gpu_environment(launch, {"CUDA_VISIBLE_DEVICES": ""}) == {}  # the node hides every GPU
    with pytest.raises(UserError, match="STAGEMESH_GPU_PER_STAGE='yes' must be one of auto, off"):
        gpu_environment(launch, {"STAGEMESH_GPU_PER_STAGE": "yes"})


def test_narrowing_survives_the_stages_re_exec():
    env = {"CUDA_VISIBLE_DEVICES": "4,6"}
    env.update(stage_gpu_environment(1, "auto", env))
    assert env["CUDA_VISIBLE_DEVICES"] == "6"
    assert stage_gpu_environment(1, "auto", env) == {}  # the second pass keeps "6", not "6"[1 % 1]


def test_own_gpu_needs_an_index_and_the_setting():
    assert stage_has_own_gpu(0, "auto") and not stage_has_own_gpu(0, "off") and not stage_has_own_gpu(None, "auto")
    assert settings.read("GPU_PER_STAGE", {}) == "auto"


def test_stages_turn_off_mlx_cuda_graphs_and_cudnn_attention_unless_the_environment_sets_them():
    from stage_worker.service.process_setup import serving_mlx_environment

    assert serving_mlx_environment({}) == {"MLX_CUDA_USE_CUDNN_SDPA": "0", "MLX_USE_CUDA_GRAPHS": "0"}
    # A user who measured otherwise keeps their choice.
    assert serving_mlx_environment({"MLX_USE_CUDA_GRAPHS": "1"}) == {"MLX_CUDA_USE_CUDNN_SDPA": "0"}
    assert serving_mlx_environment({"MLX_USE_CUDA_GRAPHS": "1", "MLX_CUDA_USE_CUDNN_SDPA": "1"}) == {}


@pytest.mark.e2e
def test_a_stage_process_runs_with_the_serving_mlx_settings(tmp_path):
    """The real entry point (``prepare``, then the BLAS re-exec) leaves them in the process MLX runs in."""
    import os
    import subprocess
    import sys

    path = tmp_path / "launch.json"
    path.write_text(_launch(StageOptions()).to_json())
    (tmp_path / "envprobe.py").write_text(
        "import os, sys\n"
        "from stage_worker.service.process_setup import prepare\n"
        "prepare('envprobe', sys.argv[1:], sys.argv[1])\n"
        "print(os.environ['MLX_USE_CUDA_GRAPHS'], os.environ['MLX_CUDA_USE_CUDNN_SDPA'])\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), *sys.path])
    out = subprocess.run([sys.executable, "-m", "envprobe", str(path)], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "0"]
