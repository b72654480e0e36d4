"""The entry engine when its own loop fails (a bug, the device): no request is left waiting.

The pipeline is a small fake that fails on submit; the engine, its scheduler and the status are real."""

from __future__ import annotations

import pytest

from stage_worker.engine.entry_engine import EntryEngine, NotAccepting, RequestFailed
from stage_worker.engine.scheduler import GenerationRequest, Scheduler
from stage_worker.engine.stage_status import StageStatus
from stagemesh_core.states import StageState


class _FailingPipeline:
    can_carry = False
    single_stage = True
    shut_down = False

    def submit(self, chunks):
        raise RuntimeError("device lost")

    def collect(self):
        raise AssertionError("nothing was submitted")

    def shutdown(self) -> None:
        self.shut_down = True


def test_a_fault_in_the_loop_fails_every_waiting_request_at_once_and_the_stage_stops_accepting():
    status = StageStatus()
    engine = EntryEngine(_FailingPipeline(), Scheduler(max_num_seqs=4, max_model_len=64, max_waiting=4),
                         status)
    handles = [engine.submit(GenerationRequest(f"r{i}", (1, 2, 3), 4)) for i in range(3)]
    with pytest.raises(RuntimeError, match="device lost"):
        engine.run()
    for handle in handles:
        event = handle.events.get(timeout=5)  # at once: delivered before the loop's exception left run()
        assert isinstance(event, RequestFailed)
        assert "the entry stage failed: RuntimeError: device lost" in event.message
    assert status.state is StageState.FAILED
    with pytest.raises(NotAccepting):
        engine.submit(GenerationRequest("late", (1, 2, 3), 4))
