"""A single-stage pipeline runs each decode step one ahead, fed the token still on the device: the
entry engine's tokens equal plain step-by-step generation on the real model, stop tokens included."""

import threading

import mlx.core as mx
import pytest

from stage_worker.checkpoint.default_model import default_model_path
from stage_worker.checkpoint.model_reader import read_model_spec
from stage_worker.engine.entry_engine import EntryEngine
from stage_worker.engine.generation_job import GenerationJob, run_generation
from stage_worker.engine.scheduler import Finish, GenerationRequest, Scheduler
from stage_worker.engine.stage_runtime import EntryPipeline, StageCompute
from stage_worker.engine.stage_status import StageStatus
from stage_worker.model.stage_model import StageModel, StageRole
from stagemesh_core.layer_split import LayerRange
from tests.engine_helpers import CountingPipeline, as_served, read_until_finished

PROMPTS = [[504, 3575, 282, 4649, 314], [1, 2, 3], [504, 3575, 282, 4649, 314, 1018, 28, 2270, 253]]


@pytest.fixture(scope="module")
def model():
    spec = read_model_spec(str(default_model_path()))
    return as_served(StageModel.load(spec, StageRole(LayerRange(0, spec.num_layers), True, True), mx.float32))


def _reference(model, max_tokens):
    pipeline = EntryPipeline(StageCompute(model, 8), None, None, is_last=True)
    return run_generation(pipeline, GenerationJob(tuple(tuple(p) for p in PROMPTS), max_tokens)).outputs


def _engine(model, max_tokens, stop=frozenset()):
    pipeline = CountingPipeline(StageCompute(model, 8), None, None, is_last=True)
    scheduler = Scheduler(max_num_seqs=8, max_model_len=256, max_waiting=8)
    engine = EntryEngine(pipeline, scheduler, StageStatus(), step_ahead=True)
    runner = threading.Thread(target=engine.run)
    runner.start()
    try:
        handles = [engine.submit(GenerationRequest(f"r{i}", tuple(p), max_tokens, stop_token_ids=stop))
                   for i, p in enumerate(PROMPTS)]
        outputs, finishes = read_until_finished(handles)
        assert pipeline.carried > 0  # the steps really ran ahead
        return outputs, finishes
    finally:
        engine.stop()
        runner.join(60)


@pytest.mark.e2e
def test_the_engine_steps_ahead_and_still_matches_step_by_step_generation(model):
    reference = _reference(model, 12)
    outputs, finishes = _engine(model, 12)
    assert outputs == reference
    assert finishes == [Finish.LENGTH] * len(PROMPTS)


@pytest.mark.e2e
def test_a_stop_token_ends_the_request_where_step_by_step_generation_would(model):
    reference = _reference(model, 12)
    stop = reference[0][4]  # the fifth token of the first prompt's answer
    outputs, finishes = _engine(model, 12, stop=frozenset({stop}))
    for out, ref, finish in zip(outputs, reference, finishes):
        cut = ref.index(stop) + 1 if stop in ref else len(ref)
        assert out == ref[:cut]
        assert finish == (Finish.STOP if stop in ref else Finish.LENGTH)


def test_steps_run_ahead_only_where_the_device_is_not_the_hosts_own_cores():
    from stage_worker.engine.entry_engine import step_ahead_pays

    assert step_ahead_pays("cuda") and step_ahead_pays("metal")
    assert not step_ahead_pays("cpu")


def test_a_longer_pipeline_continues_only_where_a_micro_batch_slot_would_stay_empty():
    from stage_worker.engine.entry_engine import continue_oldest

    assert not continue_oldest(0, 2, False, single_stage=False)
    assert continue_oldest(1, 2, has_work=False, single_stage=False)  # one stream on two stages
    assert not continue_oldest(1, 2, has_work=True, single_stage=False)  # new work fills the slot instead
    assert not continue_oldest(2, 2, has_work=False, single_stage=False)  # both stages busy already
    assert continue_oldest(1, 1, has_work=True, single_stage=True)  # a single stage always overlaps
    assert continue_oldest(1, 1, has_work=True, single_stage=False)  # so does a pipeline without micro-batches
    assert not continue_oldest(0, 1, has_work=True, single_stage=True)
