"""The CPU fast path's decisions: which BLAS to preload, how many threads, dense or quantized
weights, and the memory budget's verdicts."""

import pytest

from stage_worker.model.blas import AdaptiveBlasThreads, blas_environment, find_optimized_blas, threads_for_load
from stage_worker.model.stage_model import choose_dense_weights
from stage_worker.service.memory import MemoryBudget, MemoryBudgetError, kv_bytes_per_token, kv_token_capacity
from stage_worker.service.process_setup import blas_threads, pinned_cores
from stagemesh_core.layer_split import LayerRange
from stagemesh_core.memory import StageKV
from stagemesh_core.plan import PipelinePlan, StageLaunch, StageOptions, StagePlacement

GB = 1_000_000_000


def test_preload_is_prepended_once_and_threads_are_set():
    env = blas_environment({"LD_PRELOAD": "/x.so"}, "/blas.so", 2)
    assert env["LD_PRELOAD"] == "/blas.so:/x.so"
    assert env["OPENBLAS_NUM_THREADS"] == "2" and env["MKL_NUM_THREADS"] == "2"
    assert blas_environment(env, "/blas.so", 2)["LD_PRELOAD"] == "/blas.so:/x.so"
    assert blas_environment({}, None, 2) == {}
    assert "OPENBLAS_THREAD_TIMEOUT" not in env


def test_stages_sharing_a_host_keep_idle_blas_threads_from_spinning():
    assert blas_environment({}, "/blas.so", 2, shared_host=True)["OPENBLAS_THREAD_TIMEOUT"] == "4"
    assert blas_environment({"OPENBLAS_THREAD_TIMEOUT": "10"}, "/blas.so", 2,
                            shared_host=True)["OPENBLAS_THREAD_TIMEOUT"] == "10"


def _plan(*hosts: str, first_global_index: int = 0) -> PipelinePlan:
    stages = tuple(StagePlacement(rank=r, global_index=first_global_index + r, layers=LayerRange(r, r + 1),
                                  host=host, ring_port=30000 + r, lane_port=30100 + r, grpc_port=30200 + r)
                   for r, host in enumerate(hosts))
    return PipelinePlan(replica=0, model_path="/m", num_layers=len(hosts), compute_dtype="auto", stages=stages)


def test_stages_on_host_come_from_the_options_or_the_plan():
    plan = _plan("10.0.0.1", "10.0.0.1", "10.0.0.2")
    assert StageLaunch(plan, 0).stages_sharing_host() == 2
    assert StageLaunch(plan, 2).stages_sharing_host() == 1
    assert StageLaunch(plan, 2, StageOptions(stages_on_host=4)).stages_sharing_host() == 4


def test_a_launch_survives_its_json_and_refuses_a_rank_outside_the_plan():
    from stagemesh_core.errors import UserError

    launch = StageLaunch(_plan("a", "b"), 1, StageOptions(node_id="n", max_model_len=256, ring_timeout_s=3))
    assert StageLaunch.from_json(launch.to_json()) == launch
    with pytest.raises(UserError, match="rank 2 outside the plan's 0..1"):
        StageLaunch(_plan("a", "b"), 2)
    with pytest.raises(UserError, match="memory_fraction must be in"):
        StageOptions(memory_fraction=1.5)


def test_blas_choice_can_be_forced_or_disabled():
    assert find_optimized_blas({"STAGEMESH_BLAS": "none"}) is None
    with pytest.raises(ValueError, match="STAGEMESH_BLAS='/nope.so' does not exist"):
        find_optimized_blas({"STAGEMESH_BLAS": "/nope.so"})


def test_the_blas_pool_starts_with_every_usable_core_unless_fixed():
    assert blas_threads({}, 8) == 8
    assert blas_threads({"STAGEMESH_BLAS_THREADS": "3"}, 8) == 3
    assert blas_threads({}, 0) == 1
    for bad in ("0", "two", "-1"):
        with pytest.raises(ValueError, match=f"STAGEMESH_BLAS_THREADS='{bad}' must be a positive integer"):
            blas_threads({"STAGEMESH_BLAS_THREADS": bad}, 8)


def test_blas_threads_follow_the_pipelines_load():
    # one batch in flight: only one stage computes, it may use the whole host
    assert threads_for_load(1, cores=8, stages_on_host=2) == 8
    # two in flight on a host with two stages: they compute at once and split the cores
    assert threads_for_load(2, cores=8, stages_on_host=2) == 4
    assert threads_for_load(3, cores=8, stages_on_host=2) == 4
    assert threads_for_load(2, cores=8, stages_on_host=4) == 4
    # a stage alone on its host keeps every core whatever the load
    assert threads_for_load(4, cores=2, stages_on_host=1) == 2
    # unknown load (older peer, idle): assume every co-located stage is busy
    assert threads_for_load(0, cores=8, stages_on_host=4) == 2
    assert threads_for_load(3, cores=2, stages_on_host=3) == 1


def test_adaptive_threads_set_the_pool_only_when_the_count_changes():
    calls = []
    threads = AdaptiveBlasThreads(cores=4, stages_on_host=2)
    threads._setter = calls.append
    assert [threads.for_load(n) for n in (0, 1, 1, 2, 2, 1)] == [2, 4, 4, 2, 2, 4]
    assert calls == [2, 4, 2, 4]
    fixed = AdaptiveBlasThreads(cores=4, stages_on_host=2, fixed=3)
    assert not fixed.adaptive and fixed.for_load(1) == 3


@pytest.mark.parametrize(
    "setting,backend,blas,quantized,dense,budget,expected,why",
    [
        ("auto", "cpu", "openblas", True, 300, 1000, True, "openblas BLAS"),
        ("auto", "cpu", "reference", True, 300, 1000, False, "install libopenblas0-pthread"),
        ("auto", "metal", "accelerate", True, 300, 1000, False, "Metal"),
        ("auto", "cpu", "mkl", True, 600, 1000, False, "half this stage's memory budget"),
        ("on", "cpu", "reference", True, 300, 1000, True, "--dequantize on"),
        ("off", "cpu", "openblas", True, 300, 1000, False, "--dequantize off"),
        ("auto", "cpu", "openblas", False, 300, 1000, False, "not quantized"),
        # CUDA: the quantized kernels stall on each new batch shape, so dense whenever they fit (the BLAS is irrelevant)
        ("auto", "cuda", "reference", True, 500, 1000, True, "CUDA's quantized kernels stall on each new batch shape"),
        ("auto", "cuda", "reference", True, 501, 1000, False, "half this stage's GPU memory budget"),
        ("off", "cuda", "reference", True, 300, 1000, False, "--dequantize off"),
        ("auto", "cuda", "reference", False, 300, 1000, False, "not quantized"),
        ("on", "metal", "accelerate", True, 300, 1000, True, "--dequantize on"),
    ],
)
def test_dense_weights_weigh_speed_against_memory(setting, backend, blas, quantized, dense, budget, expected, why):
    choice, reason = choose_dense_weights(setting, backend=backend, blas=blas, quantized=quantized,
                                          dense_bytes=dense, memory_budget=budget)
    assert choice is expected and why in reason


def test_unknown_dequantize_setting_names_the_flag():
    with pytest.raises(ValueError, match="--dequantize 'maybe'"):
        choose_dense_weights("maybe", backend="cpu", blas="openblas", quantized=True, dense_bytes=1, memory_budget=2)


def test_kv_capacity_is_what_the_budget_leaves_after_weights_and_runtime():
    per_token = kv_bytes_per_token(local_layers=15, kv_heads=3, head_dim=64, dtype_bytes=4)
    assert per_token == 15 * 2 * 3 * 64 * 4
    budget = MemoryBudget(total_bytes=24 * GB, available_bytes=20 * GB, fraction=0.8, stages_on_host=2)
    tokens = kv_token_capacity(budget, weight_bytes=300_000_000, kv=StageKV(per_token),
                               element_bytes=1, max_num_seqs=8, max_model_len=8192, stage="s")
    assert tokens * per_token <= budget.budget_bytes - 300_000_000
    assert tokens > 8192


def test_a_budget_too_small_for_one_sequence_names_the_flags():
    budget = MemoryBudget(total_bytes=2 * GB, available_bytes=2 * GB, fraction=0.2, stages_on_host=1)
    with pytest.raises(MemoryBudgetError, match="--max-model-len 8192.*--memory-fraction"):
        kv_token_capacity(budget, weight_bytes=100_000_000, kv=StageKV(200_000),
                          element_bytes=1, max_num_seqs=8, max_model_len=8192, stage="stage 1")


def test_a_host_without_free_memory_is_refused():
    budget = MemoryBudget(total_bytes=64 * GB, available_bytes=100_000_000, fraction=0.8, stages_on_host=1)
    with pytest.raises(MemoryBudgetError, match="only 100 MB free"):
        kv_token_capacity(budget, weight_bytes=90_000_000, kv=StageKV(10_000),
                          element_bytes=1, max_num_seqs=8, max_model_len=4096, stage="stage 0")


def test_pinning_per_stage_puts_global_stage_g_on_core_g():
    launch = StageLaunch(_plan("a", "a", first_global_index=2), 1)
    assert pinned_cores(launch, {"STAGEMESH_PIN_CORES": "per-stage"}, 2) == {1}
    assert pinned_cores(launch, {"STAGEMESH_PIN_CORES": "0,1"}, 2) == {0, 1}
    assert pinned_cores(launch, {}, 2) is None
    with pytest.raises(ValueError, match="STAGEMESH_PIN_CORES='0,x' must be a comma-separated core list"):
        pinned_cores(launch, {"STAGEMESH_PIN_CORES": "0,x"}, 2)
