"""A stage's device: which backend, which name, how much memory; the dtype, the memory budget and the
warm-up that follow from it. Pure functions fed made-up facts, so Metal and CUDA are tested on any host."""

import mlx.core as mx
import pytest

from stage_worker.engine.warmup import WarmupPlan, largest_decode_batch, warm_up, warmup_plan
from stage_worker.model.device import (
    DeviceFacts,
    StageDevice,
    backend_of,
    cpu_model_name,
    describe,
    memory_limit_for,
    needs_nvidia_smi,
    parse_nvidia_smi_query,
    probe,
    smi_device_id,
    wired_limit,
)
from stage_worker.model.stage_model import StageModel, StageRole, resolve_compute_dtype
from stage_worker.service.memory import MemoryBudgetError, budget_for, kv_token_capacity, stages_sharing_memory
from stagemesh_core.layer_split import LayerRange
from stagemesh_core.memory import StageKV

GB = 1_000_000_000

# What MLX 0.32's mx.device_info(mx.gpu) answers on each GPU backend (keys from MLX's sources).
METAL_INFO = {"device_name": "Apple M2 Max", "architecture": "applegpu_g14s", "memory_size": 64 * GB,
              "max_recommended_working_set_size": 48 * GB, "max_buffer_length": 32 * GB}
CUDA_INFO = {"device_name": "NVIDIA H200", "architecture": "sm_90", "total_memory": 150 * GB,
             "free_memory": 140 * GB, "uuid": "GPU-0000", "pci_bus_id": "0000:19:00.0"}


@pytest.mark.parametrize("default,metal,cuda,backend", [
    ("cpu", False, False, "cpu"),
    ("cpu", True, False, "cpu"),  # a Mac told to compute on the CPU
    ("gpu", True, False, "metal"),
    ("gpu", False, True, "cuda"),
    ("gpu", False, False, "cuda"),  # a GPU that is not Metal: MLX has no third GPU backend
])
def test_the_backend_follows_mlxs_default_device(default, metal, cuda, backend):
    assert backend_of(default, metal, cuda) == backend


def test_metal_names_the_chip_and_its_architecture_and_budgets_the_working_set():
    device = describe(DeviceFacts("gpu", True, False, METAL_INFO, cpu_model="Apple M2 Max"))
    assert device == StageDevice("metal", "Apple M2 Max (applegpu_g14s)", 48 * GB, None)
    assert wired_limit(device) == 48 * GB
    older = describe(DeviceFacts("gpu", True, False, {"architecture": "applegpu_g13s", "memory_size": 16 * GB}))
    assert (older.name, older.memory_bytes) == ("applegpu_g13s", 16 * GB)


def test_a_gpu_stage_keeps_mlx_within_its_budget_and_a_cpu_stage_leaves_the_host_to_page():
    # Three servers sharing an 80 GB GPU, each at --memory-fraction 0.26: each MLX held to its 20.8 GB, where its
    # own default (0.8 of the GPU) would let one process's freed buffers crowd out the others.
    budget = budget_for(0.26, 1, host_total=128 * GB, host_available=100 * GB, backend="cuda",
                        device_total=80 * GB, device_free=79 * GB)
    assert memory_limit_for("cuda", budget.budget_bytes) == int(80 * GB * 0.26)
    assert memory_limit_for("metal", 30 * GB) == 30 * GB
    assert memory_limit_for("cpu", 10 * GB) is None


def test_cuda_takes_name_and_memory_from_mlx_else_from_nvidia_smi():
    device = describe(DeviceFacts("gpu", False, True, CUDA_INFO))
    assert device == StageDevice("cuda", "NVIDIA H200", 150 * GB, 140 * GB)
    assert wired_limit(device) is None and not needs_nvidia_smi("cuda", CUDA_INFO)
    assert needs_nvidia_smi("cuda", {}) and not needs_nvidia_smi("metal", {})
    name, total = parse_nvidia_smi_query("NVIDIA H200, 143771\n")
    assert (name, total) == ("NVIDIA H200", 143771 * 1024 * 1024)
    fallback = describe(DeviceFacts("gpu", False, True, {}, smi_name=name, smi_memory_bytes=total))
    assert (fallback.name, fallback.memory_bytes, fallback.free_bytes) == ("NVIDIA H200", total, None)
    assert parse_nvidia_smi_query(None) == (None, None) and parse_nvidia_smi_query("garbage") == (None, None)


def test_nvidia_smi_is_asked_about_the_gpu_cuda_visible_devices_names():
    assert smi_device_id({}) == "0"
    assert smi_device_id({"CUDA_VISIBLE_DEVICES": "3,1"}) == "3"
    assert smi_device_id({"CUDA_VISIBLE_DEVICES": "GPU-abc"}) == "GPU-abc"


def test_the_cpu_is_named_by_its_model():
    assert cpu_model_name("processor\t: 0\nmodel name\t: AMD EPYC 7763 64-Core Processor\n") == \
        "AMD EPYC 7763 64-Core Processor"
    assert cpu_model_name("Hardware\t: BCM2835\nModel\t\t: Raspberry Pi 4\n") == "Raspberry Pi 4"
    assert cpu_model_name(None) == ""
    device = describe(DeviceFacts("cpu", False, False, cpu_model="AMD EPYC"))
    assert device == StageDevice("cpu", "AMD EPYC", None, None) and not device.on_gpu


def test_probing_this_machine_never_fails():
    device = probe()
    assert device.backend in ("cpu", "metal", "cuda") and device.name
    assert device.summary().startswith(device.backend)


def test_auto_dtype_is_a_function_of_the_backend():
    assert resolve_compute_dtype("auto", "cpu") == mx.float32
    assert resolve_compute_dtype("auto", "metal") == mx.float16
    assert resolve_compute_dtype("auto", "cuda") == mx.bfloat16
    assert resolve_compute_dtype("float16", "cuda") == mx.float16  # an explicit dtype wins


def test_a_gpu_stage_budgets_its_gpus_memory():
    metal = budget_for(0.8, 2, host_total=64 * GB, host_available=40 * GB, backend="metal", device_total=48 * GB)
    assert (metal.total_bytes, metal.available_bytes, metal.memory) == (48 * GB, 40 * GB, "GPU")
    assert metal.budget_bytes == int(48 * GB * 0.8 / 2)
    cuda = budget_for(0.9, 1, host_total=2000 * GB, host_available=1900 * GB, backend="cuda",
                      device_total=150 * GB, device_free=140 * GB)
    assert (cuda.total_bytes, cuda.available_bytes, cuda.budget_bytes) == (150 * GB, 140 * GB, int(135 * GB))
    unknown_free = budget_for(0.9, 1, host_total=8 * GB, host_available=4 * GB, backend="cuda", device_total=80 * GB)
    assert unknown_free.available_bytes == 80 * GB
    cpu = budget_for(0.5, 2, host_total=32 * GB, host_available=20 * GB, backend="cpu", device_total=None)
    assert (cpu.total_bytes, cpu.memory, cpu.budget_bytes) == (32 * GB, "host", 8 * GB)
    # a GPU whose size is unknown falls back to the host's memory
    assert budget_for(0.5, 1, host_total=32 * GB, host_available=20 * GB, backend="cuda").memory == "host"
    with pytest.raises(MemoryBudgetError, match="--memory-fraction"):
        budget_for(0, 1, host_total=1, host_available=1)


def test_a_gpu_budget_that_cannot_hold_a_sequence_says_so():
    budget = budget_for(0.5, 4, host_total=64 * GB, host_available=60 * GB, backend="cuda", device_total=8 * GB)
    with pytest.raises(MemoryBudgetError, match="stage\\(s\\) on this GPU"):
        kv_token_capacity(budget, weight_bytes=900_000_000, kv=StageKV(1_000_000),
                          element_bytes=1, max_num_seqs=8, max_model_len=4096, stage="s")


def test_stages_share_the_gpu_they_were_given_else_the_hosts():
    assert stages_sharing_memory("cuda", stages_on_host=8, stages_on_gpu=1, own_gpu=True) == 1
    assert stages_sharing_memory("cuda", stages_on_host=8, stages_on_gpu=1, own_gpu=False) == 8  # GPU_PER_STAGE=off
    assert stages_sharing_memory("cuda", stages_on_host=8, stages_on_gpu=0, own_gpu=True) == 8  # count unknown
    assert stages_sharing_memory("metal", stages_on_host=2, stages_on_gpu=0, own_gpu=False) == 2
    assert stages_sharing_memory("cpu", stages_on_host=3, stages_on_gpu=2, own_gpu=True) == 3


def test_the_warm_up_is_tiny_on_the_cpu_and_covers_serving_sizes_on_a_gpu():
    cpu = warmup_plan("cpu", max_num_seqs=64, micro_batches=2, max_batch_tokens=512, max_model_len=4096)
    assert cpu == WarmupPlan(prefill_tokens=(), decode_batches=(1,), prompt_tokens=4)
    gpu = warmup_plan("cuda", max_num_seqs=64, micro_batches=2, max_batch_tokens=512, max_model_len=4096)
    assert gpu.prefill_tokens == (512,) and gpu.decode_batches == (1, 32)
    assert warmup_plan("metal", max_num_seqs=1, micro_batches=4, max_batch_tokens=512,
                       max_model_len=100).decode_batches == (1,)
    assert warmup_plan("cuda", max_num_seqs=8, micro_batches=1, max_batch_tokens=512,
                       max_model_len=64).prefill_tokens == (63,)
    assert largest_decode_batch(64, 3) == 22 and largest_decode_batch(5, 0) == 5
    assert "decode batches of 1 and 32" in gpu.summary() and "512-token prompt chunk" in gpu.summary()


@pytest.mark.e2e
@pytest.mark.parametrize("first,last", [(True, False), (False, True), (True, True)])
def test_the_warm_up_runs_a_slice_and_leaves_no_trace(default_model_path, first, last):
    from stage_worker.checkpoint.model_reader import read_model_spec

    model = StageModel.load(read_model_spec(default_model_path), StageRole(LayerRange(0, 2), first, last),
                            mx.float32)
    state = [mx.array(s) for s in mx.random.state]
    warm_up(model, WarmupPlan(prefill_tokens=(6,), decode_batches=(1, 3), prompt_tokens=2))
    assert all(mx.array_equal(a, b).item() for a, b in zip(state, mx.random.state))  # sampling seeds untouched
