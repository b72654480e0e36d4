"""Stage verdicts and mesh config checks (pure, no Ray)."""

from __future__ import annotations

import pytest

from coordinator.config import MeshConfig, stage_options, validate_config
from coordinator.health import StageInfoView, StageProbe, Verdict, info_view, judge
from coordinator.placement import PlacementError
from stagemesh_core.layer_split import LayerSplitError
from stagemesh_core.plan import StageOptions
from stagemesh_core.snapshots import StageStats
from stagemesh_core.states import StageState, UnknownStateError, describe_exit, state_to_proto
from stagemesh_core.v1 import stage_pb2


def _info(state: str, error: str = "") -> StageInfoView:
    return StageInfoView(StageState(state), 123, "float32", True, error, "openblas", 0, StageStats())


SERVING = StageProbe(health="SERVING", info=_info("serving"))
SLOW = StageProbe(rpc_error="health check: DEADLINE_EXCEEDED")
DOWN = StageProbe(rpc_error="health check: UNAVAILABLE")


def _not_serving(state: str, error: str = "") -> StageProbe:
    return StageProbe(health="NOT_SERVING", info=_info(state, error))



@pytest.mark.parametrize(
    ("probe", "starting", "misses", "expected"),
    [
        pytest.param(SERVING, False, 0, Verdict.SERVING, id="serving"),
        pytest.param(SERVING, False, 2, Verdict.SERVING, id="serving-resets"),
        pytest.param(StageProbe(exit_code=-9, health="SERVING"), False, 0, Verdict.FAILED, id="exited-beats-stale"),
        pytest.param(StageProbe(host_lost="ActorDiedError"), False, 0, Verdict.FAILED, id="host-lost"),
        pytest.param(_not_serving("failed", "boom"), True, 0, Verdict.FAILED, id="reports-failed"),
        pytest.param(_not_serving("draining"), False, 5, Verdict.DRAINING, id="draining-no-restart"),
        pytest.param(_not_serving("loading"), True, 9, Verdict.STARTING, id="loading"),
        pytest.param(DOWN, True, 9, Verdict.STARTING, id="port-not-up-yet"),
        pytest.param(SLOW, False, 0, Verdict.SUSPECT, id="one-slow-answer"),
        pytest.param(SLOW, False, 2, Verdict.FAILED, id="frozen"),
        pytest.param(_not_serving("connecting"), False, 1, Verdict.SUSPECT, id="not-serving-once"),
    ],
)
def test_judge(probe, starting, misses, expected):
    verdict, reason = judge(probe, starting=starting, misses=misses, max_misses=3)
    assert verdict is expected
    assert (reason is None) == (expected in (Verdict.SERVING, Verdict.STARTING, Verdict.DRAINING))


def test_failure_reasons_name_the_cause():
    assert judge(StageProbe(exit_code=3), starting=False, misses=0, max_misses=3)[1] == (
        "exited with code 3 (a neighbour failed or refused it)")
    assert judge(StageProbe(rpc_error="health check: DEADLINE_EXCEEDED"), starting=False, misses=2,
                 max_misses=3)[1] == "not serving for 3 consecutive checks (health check: DEADLINE_EXCEEDED)"
    assert describe_exit(-9) == "killed by signal 9"
    assert describe_exit(75) == "exited with code 75 (a ring operation outlived --ring-timeout)"


def _config(**overrides) -> MeshConfig:
    base = dict(model_path="/m", served_model_name="m", num_layers=30, pipeline_parallel_size=2,
                ring_base_port=30000, grpc_base_port=31000)
    return MeshConfig(**{**base, **overrides})


def test_validate_config_rejects_before_ray():
    validate_config(_config())
    with pytest.raises(PlacementError, match="overlaps --grpc-base-port"):
        validate_config(_config(grpc_base_port=30002))
    with pytest.raises(LayerSplitError, match="--pp-layer-split"):
        validate_config(_config(layer_split="40"))
    with pytest.raises(PlacementError, match="--data-parallel-size/-dp"):
        validate_config(_config(data_parallel_size=0))


def test_stage_options_keep_the_stage_defaults_for_what_the_user_left_unset():
    assert stage_options(_config(), "abc") == StageOptions(node_id="abc", connect_timeout_s=60, stages_on_host=1)
    options = stage_options(_config(max_num_seqs=8, max_model_len=512, memory_fraction=0.5), "n", stages_on_node=2)
    assert (options.max_num_seqs, options.max_model_len, options.memory_fraction, options.stages_on_host) == (
        8, 512, 0.5, 2)
    assert options.max_waiting == StageOptions().max_waiting
    assert (options.enable_prefix_caching, options.prefix_cache_block_size) == (True, 16)  # vLLM's defaults
    options = stage_options(_config(enable_prefix_caching=False, prefix_cache_block_size=32), "n")
    assert (options.enable_prefix_caching, options.prefix_cache_block_size) == (False, 32)


def test_stage_info_reads_every_state_and_refuses_an_unknown_one():
    for state in StageState:
        message = stage_pb2.StageInfo(state=state_to_proto(state), stats=stage_pb2.StageStats(batches=3, tokens=5))
        view = info_view(message)
        assert view.state is state and view.stats == StageStats(batches=3, tokens=5)
    with pytest.raises(UnknownStateError, match="does not know"):
        info_view(stage_pb2.StageInfo(state=42))


def test_stage_info_carries_the_backend_and_device():
    view = info_view(stage_pb2.StageInfo(state=state_to_proto(StageState.SERVING), backend="cuda",
                                         device="NVIDIA H200"))
    assert (view.backend, view.device) == ("cuda", "NVIDIA H200")
    assert info_view(stage_pb2.StageInfo(state=state_to_proto(StageState.LOADING))).backend == ""


def test_the_serve_log_shows_a_loading_stage_a_line_per_tenth_of_its_weights(caplog):
    import logging
    from dataclasses import replace

    from coordinator.checks import record_verdict
    from coordinator.placement import StageSlot
    from coordinator.replica import LiveStage

    stage = LiveStage(0, StageSlot(0, 1, "node", "10.0.0.2"), actor=None)
    events = []
    with caplog.at_level(logging.INFO, logger="stagemesh.coordinator"):
        for done in (0, 1_000, 3_500, 3_900, 10_000):
            info = replace(_info("loading"), stats=StageStats(load_done_bytes=done * 10**6,
                                                              load_total_bytes=10_000 * 10**6))
            record_verdict(stage, StageProbe(health="NOT_SERVING", info=info), Verdict.STARTING, None,
                           max_misses=3, seconds_running=1.0, on_event=lambda *a, **k: events.append(a))
    lines = [r.getMessage() for r in caplog.records if "read" in r.getMessage()]
    assert lines == [f"replica 0 stage 1: loading, {p}% of 10.0 GB read" for p in (10, 30, 100)]
