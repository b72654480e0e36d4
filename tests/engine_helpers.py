"""Shared by the engine tests that drive a real ``EntryEngine``: a counting pipeline and the reader of results."""

from __future__ import annotations

from stage_worker.engine import RequestFailed, RequestHandle
from stage_worker.scheduler import Finish
from stage_worker.stage_runtime import EntryPipeline


class CountingPipeline(EntryPipeline):
    """The real entry pipeline, counting the decode steps submitted before their input token was read."""

    carried = 0

    def submit(self, chunks):
        self.carried += sum(c.carried for c in chunks)
        return super().submit(chunks)


def read_until_finished(handles: list[RequestHandle], timeout_s: float = 120) -> tuple[list[list[int]], list[Finish]]:
    """Every request's tokens and finish reason, in the handles' order; a failure fails the test."""
    outputs, finishes = [], []
    for handle in handles:
        tokens: list[int] = []
        while True:
            event = handle.events.get(timeout=timeout_s)
            assert not isinstance(event, RequestFailed), event
            tokens += event.token_ids
            if event.finish is not None:
                outputs.append(tokens)
                finishes.append(event.finish)
                break
    return outputs, finishes
