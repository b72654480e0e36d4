"""A prompt that fell behind on a GenerateStream call gets what piled up as one update, in order, never
past a finish; the call waits on its wake-up, never on a queue, and misses no event queued around the wait."""

import asyncio
import queue
import threading

from stage_worker.engine.entry_engine import RequestFailed
from stage_worker.engine.scheduler import Finish, RequestEvent
from stage_worker.service.grpc_service import _coalesce, _StreamCall
from stagemesh_core.v1 import stage_pb2


def _take(q):
    return _coalesce(q.get_nowait(), q)


def _queue(*events):
    q = queue.SimpleQueue()
    for event in events:
        q.put(event)
    return q


def test_one_waiting_event_goes_alone():
    q = _queue(RequestEvent("r", (5,), None, 3, 1))
    assert _take(q) == RequestEvent("r", (5,), None, 3, 1)


def test_piled_up_tokens_merge_in_order_up_to_the_finish():
    q = _queue(RequestEvent("r", (5,), None, 3, 1), RequestEvent("r", (6,), None, 3, 2),
               RequestEvent("r", (7,), Finish.LENGTH, 3, 3), RequestEvent("other", (9,), None, 1, 1))
    assert _take(q) == RequestEvent("r", (5, 6, 7), Finish.LENGTH, 3, 3)
    assert q.get_nowait().request_id == "other"  # nothing after the finish was taken


def test_a_failure_behind_tokens_wins():
    q = _queue(RequestEvent("r", (5,), None, 3, 1), RequestFailed("the pipeline failed"))
    assert _take(q) == RequestFailed("the pipeline failed")


def test_a_finished_event_is_not_merged_further():
    q = _queue(RequestEvent("r", (5,), Finish.STOP, 3, 1), RequestEvent("r", (6,), None, 3, 2))
    assert _take(q).token_ids == (5,)


def test_logprobs_stay_with_their_tokens():
    from stage_worker.batch import TokenLogprob

    first, second = TokenLogprob(-0.5, ()), TokenLogprob(-1.5, ())
    q = _queue(RequestEvent("r", (5,), None, 3, 1, (first,)), RequestEvent("r", (6,), None, 3, 2, (second,)))
    merged = _take(q)
    assert merged.token_ids == (5, 6) and merged.logprobs == (first, second)


class _OneHandle:
    """The engine's side a GenerateStream call uses (submit, abort), handing out one request's handle."""

    def __init__(self) -> None:
        from stage_worker.engine.entry_engine import RequestHandle

        self.handle = RequestHandle("r")
        self.aborted: list[str] = []

    def submit(self, request):
        return self.handle

    def abort(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        return True


def test_a_call_wakes_for_events_queued_by_another_thread_before_or_during_its_wait():
    async def scenario():
        loop = asyncio.get_running_loop()
        engine = _OneHandle()
        call = _StreamCall(engine, {})  # type: ignore[arg-type]
        call._start(stage_pb2.GenerateRequest(request_id="r", prompt_token_ids=[1, 2, 3], max_tokens=3))
        updates = call.updates(lambda: False)
        # Queued (and woken) before the call first looks: found without waiting.
        engine.handle.events.put(RequestEvent("r", (1,), None, 3, 1))
        call.wakeup.set()
        assert [list(u.response.token_ids) for u in await anext(updates)] == [[1]]

        # Queued by the engine's thread while the call waits: the wake-up after the put ends the wait.
        def engine_thread():
            engine.handle.events.put(RequestEvent("r", (2,), None, 3, 2))
            engine.handle.events.put(RequestEvent("r", (3,), Finish.LENGTH, 3, 3))
            loop.call_soon_threadsafe(call.wakeup.set)

        waiting = asyncio.ensure_future(anext(updates))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # nothing queued yet: it waits rather than spinning or returning
        threading.Thread(target=engine_thread).start()
        (update,) = await asyncio.wait_for(waiting, 10)
        assert list(update.response.token_ids) == [2, 3]
        assert update.response.finish_reason == stage_pb2.FINISH_REASON_LENGTH
        assert not call.running and engine.aborted == []  # finished, not aborted

    asyncio.run(scenario())
