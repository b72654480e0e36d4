"""A Generate stream that fell behind sends what piled up as one message, in order, never past a finish;
a stream waits on its wake-up, never on its queue, and misses no event queued around the wait."""

import asyncio
import queue
import threading

from stage_worker.engine import RequestFailed
from stage_worker.grpc_service import _coalesce, _next_event
from stage_worker.scheduler import Finish, RequestEvent


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
    from stage_worker.row_options import TokenLogprob

    first, second = TokenLogprob(-0.5, ()), TokenLogprob(-1.5, ())
    q = _queue(RequestEvent("r", (5,), None, 3, 1, (first,)), RequestEvent("r", (6,), None, 3, 2, (second,)))
    merged = _take(q)
    assert merged.token_ids == (5, 6) and merged.logprobs == (first, second)


def test_a_stream_wakes_for_events_queued_by_another_thread_before_or_during_its_wait():
    from stage_worker.engine import RequestHandle

    async def scenario():
        loop = asyncio.get_running_loop()
        handle, wakeup = RequestHandle("r"), asyncio.Event()
        # Queued (and woken) before the stream first looks: found without waiting.
        handle.events.put(RequestEvent("r", (1,), None, 3, 1))
        wakeup.set()
        assert (await _next_event(handle, wakeup)).token_ids == (1,)

        # Queued by the engine's thread while the stream waits: the wake-up after the put ends the wait.
        def engine_thread():
            handle.events.put(RequestEvent("r", (2,), None, 3, 2))
            handle.events.put(RequestEvent("r", (3,), Finish.LENGTH, 3, 3))
            loop.call_soon_threadsafe(wakeup.set)

        waiting = asyncio.ensure_future(_next_event(handle, wakeup))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # nothing queued yet: it waits rather than spinning or returning
        threading.Thread(target=engine_thread).start()
        event = await asyncio.wait_for(waiting, 10)
        assert event == RequestEvent("r", (2, 3), Finish.LENGTH, 3, 3)

    asyncio.run(scenario())
