"""The entry stage's prefix-cache decisions in the batches it builds: hits, retains, evictions, budget."""

from stage_worker.batch import RecordFlag, SampledToken
from stage_worker.cache.prefix_cache import PrefixCache
from stage_worker.engine.scheduler import GenerationRequest, Scheduler


def _scheduler(capacity=None, block_size=4):
    return Scheduler(max_num_seqs=4, max_model_len=64, max_waiting=4, max_batch_tokens=64,
                     prefill_chunk_tokens=64, kv_token_capacity=capacity, prefix_cache=PrefixCache(block_size))


def _run_to_end(s, request, token=7):
    """Admit ``request`` and step it to its end; returns every batch's records."""
    s.add(request)
    seen = []
    while s.has_work():
        batch = s.next_batch()
        seen.extend(c.record for c in batch.chunks)
        s.on_sampled(batch, [SampledToken(c.record.seq_id, c.record.start_pos + c.record.num_tokens, token)
                             for c in batch.chunks if c.record.has(RecordFlag.SAMPLE)])
    return seen


def test_a_finished_sequence_is_retained_and_a_prompt_starting_alike_skips_its_blocks():
    s = _scheduler()
    first = _run_to_end(s, GenerationRequest("a", tuple(range(10)), 3))
    (retain,) = [r for r in first if r.has(RecordFlag.RETAIN)]
    # 10 prompt + 2 fed generated tokens on the stages: 12 positions, 3 whole blocks
    assert retain.has(RecordFlag.RELEASE) and retain.start_pos == 12 and retain.prefix_entry
    second = _run_to_end(s, GenerationRequest("b", tuple(range(10)) + (7, 7, 50, 51), 2))
    new = [r for r in second if r.has(RecordFlag.NEW_SEQUENCE)]
    assert [(r.start_pos, r.num_tokens, r.prefix_entry) for r in new] == [(12, 2, retain.prefix_entry)]
    assert s.prefix_cache is not None and (s.prefix_cache.stats.queries, s.prefix_cache.stats.hits) == (24, 12)


def test_a_prompt_that_is_a_prefix_of_a_cached_one_still_prefills_its_last_block():
    s = _scheduler()
    _run_to_end(s, GenerationRequest("a", tuple(range(12)), 1))
    second = _run_to_end(s, GenerationRequest("b", tuple(range(8)), 1))
    (new,) = [r for r in second if r.has(RecordFlag.NEW_SEQUENCE)]
    assert (new.start_pos, new.num_tokens) == (4, 4) and new.has(RecordFlag.SAMPLE)


def test_an_aborted_sequence_leaves_nothing_cached():
    s = _scheduler()
    s.add(GenerationRequest("a", tuple(range(10)), 5))
    batch = s.next_batch()
    s.abort("a")
    s.on_sampled(batch, [])
    (release,) = [c.record for c in s.next_batch().chunks]
    assert release.flags == RecordFlag.RELEASE
    assert s.prefix_cache is not None and s.prefix_cache.cached_blocks == 0


def test_cached_prefixes_are_evicted_for_a_reservation_that_would_not_fit_beside_them():
    s = _scheduler(capacity=32)
    _run_to_end(s, GenerationRequest("a", tuple(range(100, 116)), 1))  # 16 tokens cached
    _run_to_end(s, GenerationRequest("b", tuple(range(200, 208)), 1))  # 8 more: 24 of 32
    assert s.prefix_cache is not None and s.prefix_cache.cached_tokens == 24
    records = _run_to_end(s, GenerationRequest("c", tuple(range(300, 315)), 2))  # reserves 17: evict "a" only
    evicted = [r for r in records if r.has(RecordFlag.EVICT)]
    assert len(evicted) == 1 and s.prefix_cache.stats.evicted_blocks == 4
    assert s.reserved_tokens == 0 and s.finished_count == 3


def test_a_hit_that_would_not_fit_beside_its_reservation_is_not_taken():
    s = _scheduler(capacity=24)
    _run_to_end(s, GenerationRequest("a", tuple(range(12)), 1))  # 12 cached
    s.add(GenerationRequest("b", tuple(range(12)) + (1,), 11))  # reserves 24: the cache must go
    records = [c.record for c in s.next_batch().chunks]
    assert [r.prefix_entry for r in records if r.has(RecordFlag.EVICT)] != []
    (new,) = [r for r in records if r.has(RecordFlag.NEW_SEQUENCE)]
    assert (new.start_pos, new.num_tokens, new.prefix_entry) == (0, 13, 0)
    assert s.prefix_cache is not None and s.prefix_cache.stats.hits == 0


def test_a_referenced_prefix_is_not_evicted_before_its_copy_is_sent():
    s = _scheduler(capacity=30)
    _run_to_end(s, GenerationRequest("a", tuple(range(12)), 1))  # 12 cached
    s.add(GenerationRequest("b", tuple(range(12)) + (1,), 2))  # hits 12, reserves 15: 27 of 30
    s.add(GenerationRequest("c", (90, 91, 92), 2))  # 5 more would need the referenced entry's place
    first = [c.record for c in s.next_batch().chunks]
    assert not [r for r in first if r.has(RecordFlag.EVICT)]
    (new,) = [r for r in first if r.has(RecordFlag.NEW_SEQUENCE)]
    assert (new.seq_id, new.start_pos) == (2, 12)  # "c" waits
    second = [c.record for c in s.next_batch().chunks]  # b's copy has been sent: now the entry may go
    assert [r.prefix_entry for r in second if r.has(RecordFlag.EVICT)] == [new.prefix_entry]
    assert [r.seq_id for r in second if r.has(RecordFlag.NEW_SEQUENCE)] == [3]


def _events_to_end(s, request, token=7):
    """Admit ``request`` and step it to its end; returns its request events."""
    s.add(request)
    events = []
    while s.has_work():
        batch = s.next_batch()
        events += s.on_sampled(batch, [SampledToken(c.record.seq_id, c.record.start_pos + c.record.num_tokens, token)
                                       for c in batch.chunks if c.record.has(RecordFlag.SAMPLE)])
    return events


def test_every_event_reports_the_positions_restored_not_those_looked_up():
    s = _scheduler()
    assert {e.cached_tokens for e in _events_to_end(s, GenerationRequest("a", tuple(range(10)), 3))} == {0}
    hit = _events_to_end(s, GenerationRequest("b", tuple(range(10)) + (7, 7, 50, 51), 2))
    assert {e.cached_tokens for e in hit} == {12}  # the entry's 3 whole blocks: what the stages copied
    # A hit given up for the reservation (the cache must make way) restored nothing, and says so.
    s = _scheduler(capacity=24)
    _events_to_end(s, GenerationRequest("a", tuple(range(12)), 1))
    refused = _events_to_end(s, GenerationRequest("b", tuple(range(12)) + (1,), 11))
    assert {e.cached_tokens for e in refused} == {0} and s.prefix_cache is not None and s.prefix_cache.stats.hits == 0


def _exact_scheduler(capacity=None, block_size=4):
    return Scheduler(max_num_seqs=4, max_model_len=64, max_waiting=4, max_batch_tokens=64,
                     prefill_chunk_tokens=64, kv_token_capacity=capacity,
                     prefix_cache=PrefixCache(block_size, exact=True))


def _batches_to_end(s, request, token=7):
    """Like ``_run_to_end``, but each batch's records apart."""
    s.add(request)
    batches = []
    while s.has_work():
        batch = s.next_batch()
        batches.append([c.record for c in batch.chunks])
        s.on_sampled(batch, [SampledToken(c.record.seq_id, c.record.start_pos + c.record.num_tokens, token)
                             for c in batch.chunks if c.record.has(RecordFlag.SAMPLE)])
    return batches


def test_a_whole_state_cache_checkpoints_each_prompt_before_its_last_token():
    s = _exact_scheduler()
    prompt = tuple(range(10))
    batches = _batches_to_end(s, GenerationRequest("a", prompt, 3))
    # The prefill stops one token short; the next batch keeps that state (RETAIN without RELEASE) before the
    # last prompt token is fed and sampled.
    first, second = batches[0], batches[1]
    assert [(r.start_pos, r.num_tokens, r.flags) for r in first] == [(0, 9, RecordFlag.NEW_SEQUENCE)]
    checkpoint, last = second
    assert (checkpoint.start_pos, checkpoint.num_tokens, checkpoint.flags) == (9, 0, RecordFlag.RETAIN)
    assert (last.start_pos, last.num_tokens, last.flags) == (9, 1, RecordFlag.SAMPLE)
    finished = [r for b in batches for r in b if r.has(RecordFlag.RELEASE)]
    assert [(r.start_pos, r.flags) for r in finished] == [(12, RecordFlag.RELEASE | RecordFlag.RETAIN)]
    assert s.prefix_cache is not None and s.prefix_cache.cached_tokens == 9 + 12  # both kept: neither supersedes
    # The same prompt again (a regenerated turn) restores the checkpoint and prefills one token.
    again = [r for b in _batches_to_end(s, GenerationRequest("b", prompt, 2)) for r in b]
    (new,) = [r for r in again if r.has(RecordFlag.NEW_SEQUENCE)]
    assert (new.start_pos, new.num_tokens, new.prefix_entry) == (9, 1, checkpoint.prefix_entry)
    assert not [r for r in again if r.flags == RecordFlag.RETAIN]  # nothing new to checkpoint


def test_a_later_turns_checkpoint_supersedes_the_earlier_turns_entries():
    s = _exact_scheduler()
    _batches_to_end(s, GenerationRequest("a", tuple(range(10)), 3))  # checkpoint 9, finished 12
    turn = tuple(range(10)) + (7, 7, 7) + (50, 51, 52)  # the reply re-sent, then the user's next message
    batches = _batches_to_end(s, GenerationRequest("b", turn, 2))
    records = [r for b in batches for r in b]
    (new,) = [r for r in records if r.has(RecordFlag.NEW_SEQUENCE)]
    assert (new.start_pos, new.num_tokens) == (12, 3)  # from the finished state, one short of the prompt's end
    (checkpoint,) = [r for r in records if r.flags == RecordFlag.RETAIN]
    assert checkpoint.start_pos == 15
    assert len([r for r in records if r.has(RecordFlag.EVICT)]) == 2  # turn 1's checkpoint and finished state
    assert s.prefix_cache is not None and s.prefix_cache.cached_tokens == 15 + 17


def test_short_prompts_and_a_full_kv_budget_take_no_checkpoint():
    s = _exact_scheduler(block_size=8)
    short = [r for b in _batches_to_end(s, GenerationRequest("a", tuple(range(8)), 1)) for r in b]
    assert [(r.start_pos, r.num_tokens) for r in short if r.num_tokens] == [(0, 8)]  # no block's worth to keep
    tight = _exact_scheduler(capacity=20)
    records = [r for b in _batches_to_end(tight, GenerationRequest("b", tuple(range(12)), 8)) for r in b]
    # 20 reserved of 20: the checkpoint would not fit, so nothing is kept while the sequence runs.
    assert not [r for r in records if r.flags == RecordFlag.RETAIN]
