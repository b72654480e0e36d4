"""A Generate stream that fell behind sends what piled up as one message, in order, never past a finish."""

import queue

from stage_worker.engine import RequestFailed
from stage_worker.grpc_service import _coalesce
from stage_worker.scheduler import Finish, RequestEvent


def _queue(*events):
    q = queue.SimpleQueue()
    for event in events:
        q.put(event)
    return q


def test_one_waiting_event_goes_alone():
    q = _queue(RequestEvent("r", (5,), None, 3, 1))
    assert _coalesce(q) == RequestEvent("r", (5,), None, 3, 1)


def test_piled_up_tokens_merge_in_order_up_to_the_finish():
    q = _queue(RequestEvent("r", (5,), None, 3, 1), RequestEvent("r", (6,), None, 3, 2),
               RequestEvent("r", (7,), Finish.LENGTH, 3, 3), RequestEvent("other", (9,), None, 1, 1))
    assert _coalesce(q) == RequestEvent("r", (5, 6, 7), Finish.LENGTH, 3, 3)
    assert q.get_nowait().request_id == "other"  # nothing after the finish was taken


def test_a_failure_behind_tokens_wins():
    q = _queue(RequestEvent("r", (5,), None, 3, 1), RequestFailed("the pipeline failed"))
    assert _coalesce(q) == RequestFailed("the pipeline failed")


def test_a_finished_event_is_not_merged_further():
    q = _queue(RequestEvent("r", (5,), Finish.STOP, 3, 1), RequestEvent("r", (6,), None, 3, 2))
    assert _coalesce(q).token_ids == (5,)
