"""Entry-stage scheduling: join/leave every step, chunked prefill, releases, bounds."""

import pytest

from stage_worker.batch import RecordFlag, SampledToken
from stage_worker.engine.scheduler import Finish, GenerationRequest, QueueFullError, RequestError, Scheduler


def _scheduler(**overrides):
    options = dict(max_num_seqs=2, max_model_len=64, max_waiting=2, max_batch_tokens=8, prefill_chunk_tokens=8)
    options.update(overrides)
    return Scheduler(**options)


def _request(rid, prompt_len=3, max_tokens=3, stop=frozenset()):
    return GenerationRequest(rid, tuple(range(10, 10 + prompt_len)), max_tokens, stop_token_ids=stop)


def _sample(batch, token=7):
    """Pretend the pipeline sampled ``token`` for every record that asked for a sample."""
    return [SampledToken(c.record.seq_id, c.record.start_pos + c.record.num_tokens, token)
            for c in batch.chunks if c.record.has(RecordFlag.SAMPLE)]


def test_a_request_prefills_then_decodes_until_max_tokens():
    s = _scheduler()
    s.add(_request("a", prompt_len=3, max_tokens=3))
    batch = s.next_batch()
    (chunk,) = batch.chunks
    assert chunk.token_ids == (10, 11, 12) and chunk.record.start_pos == 0
    assert chunk.record.flags == RecordFlag.NEW_SEQUENCE | RecordFlag.SAMPLE
    events = s.on_sampled(batch, _sample(batch, 7))
    assert [(e.token_ids, e.finish) for e in events] == [((7,), None)]
    batch = s.next_batch()
    (chunk,) = batch.chunks
    assert chunk.token_ids == (7,) and chunk.record.start_pos == 3 and chunk.record.num_tokens == 1
    s.on_sampled(batch, _sample(batch, 8))
    batch = s.next_batch()
    assert batch.chunks[0].record.start_pos == 4
    events = s.on_sampled(batch, _sample(batch, 9))
    assert events[0].finish == Finish.LENGTH and events[0].completion_tokens == 3
    # the finished sequence's KV is released in the next batch, with no tokens
    (release,) = s.next_batch().chunks
    assert release.record.has(RecordFlag.RELEASE) and release.record.num_tokens == 0
    assert not s.has_work()


def test_stop_token_finishes_with_stop():
    s = _scheduler()
    s.add(_request("a", stop=frozenset({2})))
    batch = s.next_batch()
    (event,) = s.on_sampled(batch, _sample(batch, 2))
    assert event.finish == Finish.STOP and event.token_ids == (2,)


def test_sequences_join_and_leave_between_steps_and_decodes_go_first():
    s = _scheduler(max_num_seqs=3, max_batch_tokens=16, prefill_chunk_tokens=16)
    s.add(_request("a", max_tokens=2))
    first = s.next_batch()
    s.on_sampled(first, _sample(first))
    s.add(_request("b", prompt_len=5))
    batch = s.next_batch()
    kinds = [(c.record.seq_id, c.record.num_tokens) for c in batch.chunks]
    assert kinds == [(1, 1), (2, 5)]  # a's decode, then b's prefill joining
    events = s.on_sampled(batch, _sample(batch))
    assert {e.request_id: e.finish for e in events} == {"a": Finish.LENGTH, "b": None}
    batch = s.next_batch()
    assert [c.record.num_tokens for c in batch.chunks] == [0, 1]  # a's release, b's decode


def test_long_prompt_is_prefilled_in_chunks_without_stalling_decodes():
    s = _scheduler(max_num_seqs=2, max_batch_tokens=4, prefill_chunk_tokens=4)
    s.add(_request("short", prompt_len=2, max_tokens=10))
    batch = s.next_batch()
    s.on_sampled(batch, _sample(batch))
    s.add(_request("long", prompt_len=10))
    sizes = []
    for _ in range(4):
        batch = s.next_batch()
        sizes.append([(c.record.seq_id, c.record.start_pos, c.record.num_tokens, c.record.has(RecordFlag.SAMPLE))
                      for c in batch.chunks])
        s.on_sampled(batch, _sample(batch))
    assert sizes[0] == [(1, 2, 1, True), (2, 0, 3, False)]
    assert sizes[1] == [(1, 3, 1, True), (2, 3, 3, False)]
    assert sizes[2] == [(1, 4, 1, True), (2, 6, 3, False)]
    assert sizes[3] == [(1, 5, 1, True), (2, 9, 1, True)]  # last chunk samples


def test_decodes_are_listed_in_the_order_prompts_finished_not_the_order_requests_came():
    """The stages' decode groups hold sequences in the order they joined (after their last prompt chunk);
    a batch listing them otherwise makes every stage rebuild its group (kv_store._regroup)."""
    s = _scheduler(max_num_seqs=3, max_batch_tokens=8, prefill_chunk_tokens=4)
    s.add(_request("long", prompt_len=10, max_tokens=20))
    s.add(_request("short", prompt_len=2, max_tokens=20))
    order = []
    for _ in range(5):
        batch = s.next_batch()
        order.append([c.record.seq_id for c in batch.chunks if c.record.num_tokens == 1 and
                      not c.record.has(RecordFlag.NEW_SEQUENCE)])
        s.on_sampled(batch, _sample(batch))
    assert order[1] == [2]  # short finished its prompt in the first batch; long is still prefilling
    assert order[-1] == [2, 1]  # then long joins after it, although it was admitted first
    s.add(_request("third", prompt_len=2, max_tokens=20))
    batch = s.next_batch()
    s.on_sampled(batch, _sample(batch))
    batch = s.next_batch()
    assert [c.record.seq_id for c in batch.chunks] == [2, 1, 3]


def test_admission_is_bounded_by_running_slots_and_the_waiting_queue():
    s = _scheduler(max_num_seqs=1, max_waiting=1)
    s.add(_request("a"))
    s.add(_request("b"))  # a free slot still counts as room
    with pytest.raises(QueueFullError):
        s.add(_request("c"))  # one slot + one waiting place, both taken
    s.next_batch()
    assert s.num_running == 1 and s.num_waiting == 1
    full = r"1 sequences running \(--max-num-seqs 1\) and 1 waiting \(--max-waiting 1\)"
    with pytest.raises(QueueFullError, match=full):
        s.add(_request("c"))


def test_requests_that_cannot_fit_are_refused_with_the_field_to_change():
    s = _scheduler(max_model_len=10)
    with pytest.raises(RequestError, match=r"prompt \(8 tokens\) \+ max_tokens \(3\) = 11 exceeds the model length 10"):
        s.add(_request("a", prompt_len=8, max_tokens=3))
    with pytest.raises(RequestError, match="max_tokens must be at least 1"):
        s.add(_request("a", max_tokens=0))
    with pytest.raises(RequestError, match="at least one token"):
        s.add(GenerationRequest("a", (), 3))


def test_abort_while_waiting_in_flight_or_idle():
    s = _scheduler(max_num_seqs=1)
    s.add(_request("a"))
    s.add(_request("b"))
    assert s.abort("b").finish == Finish.ABORT  # waiting: gone at once
    batch = s.next_batch()
    assert s.abort("a").finish == Finish.ABORT  # in flight: retired when the batch returns
    assert s.on_sampled(batch, _sample(batch)) == []
    (release,) = s.next_batch().chunks
    assert release.record.has(RecordFlag.RELEASE)
    assert s.abort("a") is None and s.abort("nope") is None


def test_kv_capacity_admits_only_what_every_stage_can_hold():
    s = _scheduler(max_num_seqs=4, max_waiting=4, kv_token_capacity=14)
    s.add(_request("a", prompt_len=3, max_tokens=4))  # reserves 7
    s.add(_request("b", prompt_len=3, max_tokens=4))  # 14: fits exactly
    s.add(_request("c", prompt_len=3, max_tokens=4))  # must wait
    batch = s.next_batch()
    assert {c.record.seq_id for c in batch.chunks} == {1, 2} and s.num_waiting == 1
    assert s.reserved_tokens == 14
    s.abort("a")
    s.on_sampled(batch, _sample(batch))
    assert s.reserved_tokens == 7
    assert any(c.token_ids == (10, 11, 12) and c.record.seq_id == 3 for c in s.next_batch().chunks)
    with pytest.raises(RequestError, match="exceeds the KV capacity of the pipeline"):
        s.add(_request("d", prompt_len=10, max_tokens=5))


def test_micro_batches_split_the_running_sequences():
    s = _scheduler(max_num_seqs=4, max_batch_tokens=64, prefill_chunk_tokens=64)
    for rid in "abcd":
        s.add(_request(rid))
    first, second = s.next_batch(micro_batches=2), s.next_batch(micro_batches=2)
    assert [c.record.seq_id for c in first.chunks] == [1, 2]
    assert [c.record.seq_id for c in second.chunks] == [3, 4]
    assert not s.has_work()  # everything is in flight
    s.on_sampled(first, _sample(first))
    third = s.next_batch(micro_batches=2)
    assert [(c.record.seq_id, c.record.num_tokens) for c in third.chunks] == [(1, 1), (2, 1)]


def test_continuations_run_one_step_ahead_and_stop_at_the_length_limit():
    s = _scheduler()
    s.add(_request("a", prompt_len=3, max_tokens=3))
    first = s.next_batch()
    second = s.continuation(first)  # submitted before the first step's token is read
    (chunk,) = second.chunks
    assert chunk.carried and chunk.token_ids == () and chunk.record.start_pos == 3
    assert chunk.record.num_tokens == 1 and chunk.record.has(RecordFlag.SAMPLE)
    assert not s.has_work()  # both steps in flight: nothing more to schedule for "a"
    assert [e.token_ids for e in s.on_sampled(first, _sample(first, 7))] == [(7,)]
    third = s.continuation(second)
    assert [c.record.start_pos for c in third.chunks] == [4]
    assert [e.finish for e in s.on_sampled(second, _sample(second, 8))] == [None]
    # after "third" the request has its 3 tokens: no fourth step is continued
    assert s.continuation(third).chunks == ()
    events = s.on_sampled(third, _sample(third, 9))
    assert [(e.token_ids, e.finish, e.completion_tokens) for e in events] == [((9,), Finish.LENGTH, 3)]
    assert s.num_running == 0


def test_a_stop_token_drops_the_step_already_continued_and_releases_the_kv():
    s = _scheduler()
    s.add(_request("a", prompt_len=3, max_tokens=10, stop=frozenset({2})))
    first = s.next_batch()
    second = s.continuation(first)
    events = s.on_sampled(first, _sample(first, 2))  # the stop token
    assert [(e.token_ids, e.finish) for e in events] == [((2,), Finish.STOP)]
    assert s.on_sampled(second, _sample(second, 5)) == []  # the continued step's token is discarded
    releases = s.next_batch().chunks
    assert [(c.record.seq_id, c.record.has(RecordFlag.RELEASE)) for c in releases] == [(1, True)]


def test_new_requests_join_a_batch_beside_continuations():
    s = _scheduler()
    s.add(_request("a", prompt_len=3, max_tokens=10))
    first = s.next_batch()
    s.add(_request("b", prompt_len=2, max_tokens=10))
    continued = s.continuation(first)
    joined = s.next_batch(1)
    assert [c.carried for c in continued.chunks] == [True]
    assert [(c.record.seq_id, c.token_ids) for c in joined.chunks] == [(2, (10, 11))]


def test_a_sequences_options_ride_its_first_chunk_only_and_its_sampling_every_record():
    from stagemesh_core.sampling import SamplingParams

    sampling = SamplingParams(temperature=0.5, seed=3, presence_penalty=0.5)
    s = _scheduler(max_batch_tokens=6, prefill_chunk_tokens=4)
    s.add(GenerationRequest("a", tuple(range(10, 16)), 3, sampling, stop_token_ids=frozenset({2})))
    s.add(_request("plain", prompt_len=2))  # greedy, nothing for the last stage beyond its records
    first = s.next_batch()
    by_seq = {c.record.seq_id: c for c in first.chunks}
    a, plain = by_seq[1], by_seq[2]
    assert a.options is not None and a.options.sampling == sampling and a.options.prompt_len == 6
    assert plain.options is None and plain.record.sampling.greedy
    s.on_sampled(first, _sample(first))
    second = s.next_batch()
    rest = next(c for c in second.chunks if c.record.seq_id == 1)
    assert rest.token_ids == (14, 15) and rest.options is None and rest.record.sampling is sampling
