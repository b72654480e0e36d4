"""Pipelines that build ahead: the entry stage queues each decode step before the tokens it continues from
are back (built on a placeholder, run when the reply comes), and every other stage builds each batch as soon
as its header is in (a middle stage announcing its own downstream first). The real model split in two or
three, real control lanes over loopback, each relay in its own thread: the tokens equal step-by-step
generation on one stage, stop tokens and micro-batches included.
"""

import threading

import mlx.core as mx
import pytest

from stage_worker.checkpoint.default_model import default_model_path
from stage_worker.checkpoint.model_reader import read_model_spec
from stage_worker.engine.entry_engine import EntryEngine
from stage_worker.engine.generation_job import GenerationJob, run_generation
from stage_worker.engine.scheduler import Finish, GenerationRequest, Scheduler
from stage_worker.engine.stage_runtime import EntryPipeline, StageCompute, relay_loop
from stage_worker.engine.stage_status import StageStatus
from stage_worker.model.stage_model import StageModel, StageRole
from stagemesh_core.layer_split import LayerRange
from tests.engine_helpers import CountingPipeline, as_served, lane, read_until_finished

pytestmark = pytest.mark.e2e

PROMPTS = [[504, 3575, 282, 4649, 314], [1, 2, 3], [504, 3575, 282, 4649, 314, 1018, 28, 2270, 253],
           [17, 42, 99, 1000]]
SPLITS = {2: (0, 13, 30), 3: (0, 9, 21, 30)}


@pytest.fixture(scope="module")
def models():
    """The whole model, and its stages for each pipeline depth."""
    spec = read_model_spec(str(default_model_path()))
    whole = as_served(StageModel.load(spec, StageRole(LayerRange(0, spec.num_layers), True, True), mx.float32))
    stages = {
        depth: [as_served(StageModel.load(spec, StageRole(LayerRange(lo, hi), lo == 0, hi == spec.num_layers),
                                          mx.float32))
                for lo, hi in zip(bounds, bounds[1:])]
        for depth, bounds in SPLITS.items()
    }
    return whole, stages


@pytest.fixture(scope="module")
def reference(models):
    pipeline = EntryPipeline(StageCompute(models[0], 8), None, None, is_last=True)
    return run_generation(pipeline, GenerationJob(tuple(tuple(p) for p in PROMPTS), 12)).outputs


def _serve(models, micro_batches, stop=frozenset(), build_ahead=True, prompts=PROMPTS, depth=2):
    stages = models[1][depth]
    # lanes[g]: from stage g to stage g+1 (the last one wraps round to the entry stage)
    lanes = [lane(f"stage {g}", f"stage {(g + 1) % depth}") for g in range(depth)]
    relays = [threading.Thread(target=relay_loop,
                               args=(StageCompute(stages[g], 8), lanes[g - 1][0], lanes[g][1], g == depth - 1),
                               kwargs={"build_ahead": build_ahead}) for g in range(1, depth)]
    for relay in relays:
        relay.start()
    pipeline = CountingPipeline(StageCompute(stages[0], 8), lanes[0][1], lanes[-1][0], is_last=False,
                                build_ahead=build_ahead)
    scheduler = Scheduler(max_num_seqs=8, max_model_len=256, max_waiting=8)
    engine = EntryEngine(pipeline, scheduler, StageStatus(), micro_batches=micro_batches, step_ahead=True)
    runner = threading.Thread(target=engine.run)
    runner.start()
    try:
        handles = [engine.submit(GenerationRequest(f"r{i}", tuple(p), 12, stop_token_ids=stop))
                   for i, p in enumerate(prompts)]
        outputs, finishes = read_until_finished(handles)
        return outputs, finishes, pipeline.carried
    finally:
        engine.stop()
        runner.join(60)
        for relay in relays:
            relay.join(60)  # the engine's shutdown sends SHUTDOWN round the ring
        for inbound, outbound, watchdog in lanes:
            inbound.close()
            outbound.close()
            watchdog.close()
        assert not runner.is_alive() and not any(relay.is_alive() for relay in relays)


@pytest.mark.parametrize(("depth", "micro_batches", "prompts"),
                         [(2, 1, PROMPTS), (2, 2, PROMPTS[:1]), (3, 1, PROMPTS), (3, 3, PROMPTS[:2])])
def test_decode_steps_built_ahead_match_step_by_step_generation(models, reference, depth, micro_batches, prompts):
    # More micro-batch slots than sequences: a slot stays empty, so steps are built ahead there too.
    outputs, finishes, carried = _serve(models, micro_batches, prompts=prompts, depth=depth)
    assert carried > 0  # steps really were built before the tokens they continue from came back
    assert outputs == reference[:len(prompts)]
    assert finishes == [Finish.LENGTH] * len(prompts)


def test_a_stop_token_ends_the_request_where_step_by_step_generation_would(models, reference):
    stop = reference[0][4]  # the fifth token of the first prompt's answer
    outputs, finishes, carried = _serve(models, 1, stop=frozenset({stop}))
    assert carried > 0
    for out, ref, finish in zip(outputs, reference, finishes):
        cut = ref.index(stop) + 1 if stop in ref else len(ref)
        assert out == ref[:cut]
        assert finish == (Finish.STOP if stop in ref else Finish.LENGTH)


def test_without_building_ahead_a_longer_pipeline_does_not_carry_and_still_matches(models, reference):
    outputs, _, carried = _serve(models, 1, build_ahead=False)
    assert carried == 0 and outputs == reference
