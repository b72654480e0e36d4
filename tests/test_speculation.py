"""Speculative decoding's pure parts: the flag's checks, prompt lookup, the acceptance rule, which
sequences speculate, how the scheduler feeds and cuts a verification, and a stage's KV dropping rejected
positions."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from stage_worker.batch import RecordFlag, SampledToken
from stage_worker.cache.kv_store import KVStore
from stage_worker.engine.scheduler import Finish, GenerationRequest, Scheduler
from stage_worker.speculation.ngram_proposer import propose_ngram
from stage_worker.speculation.rules import (
    PAUSE_STEPS,
    Acceptance,
    SpecDecodeCounter,
    VerifyLayout,
    accept_proposals,
    drafts_body,
    drafts_from_body,
    speculative_tokens,
)
from stage_worker.transport.wire import WireMismatchError
from stagemesh_core.plan import StageOptions
from stagemesh_core.sampling import SamplingParams
from stagemesh_core.speculative import SpeculativeConfig, SpeculativeConfigError, parse_speculative_config

NGRAM = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1)


# -- the flag -----------------------------------------------------------------------------------------------
def test_the_flag_takes_vllms_keys_and_defaults():
    config = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4}')
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (5, 5)
    config = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}')
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (3, 3)
    config = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2, '
                                      '"prompt_lookup_max": 4, "disable_by_batch_size": 8}')
    assert config == SpeculativeConfig(2, "ngram", 4, 2, 8)
    # A draft model, as vLLM takes it: "model" alone, or with the method "draft_model".
    draft = parse_speculative_config('{"model": "/models/draft", "num_speculative_tokens": 4}')
    assert (draft.method, draft.model, draft.num_speculative_tokens) == ("draft_model", "/models/draft", 4)
    assert parse_speculative_config('{"method": "draft_model", "model": "/models/draft", '
                                    '"num_speculative_tokens": 4}') == draft
    assert SpeculativeConfig.from_json(draft.to_json()) == draft


def test_unset_the_batch_size_limit_is_the_backends():
    """An NVIDIA GPU speculates for a lone sequence only (docs/performance.md); other backends up to 4; a given
    limit is kept everywhere, and memory is planned for the largest default."""
    unset = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4}')
    assert unset.disable_by_batch_size is None
    assert [unset.limit_for(b) for b in ("cpu", "metal", "cuda", None)] == [4, 4, 1, 4]
    given = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 8}')
    assert [given.limit_for(b) for b in ("cpu", "cuda")] == [8, 8]
    assert SpeculativeConfig.from_json(unset.to_json()) == unset


@pytest.mark.parametrize(("text", "names"), [
    ('{"method": "eagle", "num_speculative_tokens": 4}', "method 'eagle'"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be in 1..16"),
    ('{"method": "ngram", "num_speculative_tokens": 17}', "num_speculative_tokens must be in 1..16"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
     "prompt_lookup_min (4) must not exceed prompt_lookup_max (2)"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "lookahead": 2}', "unknown key 'lookahead'"),
    ('{"method": "draft_model", "num_speculative_tokens": 4}', "needs \"model\""),
    ('{"method": "ngram", "model": "/models/draft", "num_speculative_tokens": 4}', "\"model\" is a draft model"),
    ('{"model": "/models/draft", "num_speculative_tokens": 4, "prompt_lookup_max": 3}',
     "prompt_lookup_max is prompt lookup's"),
    ('{"model": "/models/draft", "num_speculative_tokens": 17}', "num_speculative_tokens must be in 1..16"),
    ('{"method": "ngram"}', "num_speculative_tokens\" is missing"),
    ('{"num_speculative_tokens": 2}', "\"method\" is missing"),
    ('{"method": "ngram", "num_speculative_tokens": "4"}', "num_speculative_tokens must be an integer"),
    ("ngram", "not valid JSON"),
])
def test_a_wrong_flag_is_refused_naming_the_key(text, names):
    with pytest.raises(SpeculativeConfigError, match="--speculative-config") as error:
        parse_speculative_config(text)
    assert names in str(error.value)


def test_the_config_reaches_every_stage_through_the_launch_file():
    options = StageOptions(speculative=NGRAM)
    from dataclasses import asdict

    assert StageOptions.from_dict(asdict(options)) == options
    assert StageOptions.from_dict(asdict(StageOptions())).speculative is None


# -- prompt lookup -----------------------------------------------------------------------------------------
def test_the_longest_recurring_suffix_proposes_what_followed_its_latest_occurrence():
    #          0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [1, 2, 3, 4, 9, 1, 2, 3, 4, 5, 1, 2]
    assert propose_ngram(tokens, 3, 2, 3) == (3, 4, 5)  # [1, 2] last at 5..6, followed by 3 4 5
    assert propose_ngram(tokens + [3, 4], 2, 1, 4) == (5, 1)  # [1 2 3 4] last at 5..8
    assert propose_ngram(tokens + [3, 4, 9], 2, 1, 5) == (1, 2)  # [2 3 4 9]: only at 1..4
    assert propose_ngram([1, 2, 3, 4], 3, 1, 3) == ()  # nothing recurs
    assert propose_ngram([8, 8], 2, 2, 3) == ()  # too short for the shortest suffix


def test_a_loop_gets_proposals_that_go_on_looping():
    assert propose_ngram([7, 7, 7], 4, 1, 3) == (7, 7, 7, 7)
    assert propose_ngram([5, 1, 2, 3, 1, 2], 5, 1, 3) == (3, 1, 2, 3, 1)


def test_proposals_never_exceed_k():
    tokens = list(range(20)) * 3
    assert propose_ngram(tokens, 4, 2, 5) == (0, 1, 2, 3)


# -- acceptance ------------------------------------------------------------------------------------------------
def test_acceptance_keeps_the_agreeing_prefix_and_one_more():
    assert accept_proposals([4, 5, 6, 7], [4, 5, 6]) == (4, 5, 6, 7)  # all accepted plus the bonus
    assert accept_proposals([4, 9, 6, 7], [4, 5, 6]) == (4, 9)  # the first disagreement is the target's token
    assert accept_proposals([8, 5, 6, 7], [4, 5, 6]) == (8,)
    with pytest.raises(ValueError):
        accept_proposals([1, 2], [1, 2])


def test_drafts_travel_in_the_forward_body():
    assert drafts_from_body(drafts_body({3: (1, 2), 9: (4,)})) == {3: (1, 2), 9: (4,)}
    assert drafts_body({}) is None and drafts_from_body(None) == {} and drafts_from_body({"rows": {}}) == {}


def test_counters_count_drafts_tokens_and_positions():
    counter = SpecDecodeCounter(3)
    counter.record(3, 2)
    counter.record(3, 0)
    counts = counter.counts
    assert (counts.drafts, counts.draft_tokens, counts.accepted_tokens) == (2, 6, 2)
    assert counts.accepted_per_position == (1, 1, 0)


# -- which rows a verification keeps, and what each row counts -------------------------------------------------
def test_a_verifications_rows_are_laid_out_as_if_its_proposals_were_generated():
    # A plain row, a verification of proposals (7, 8, 9), a plain row.
    layout = VerifyLayout.of([None, (7, 8, 9), None])
    assert layout.preceding == ((), (), (7,), (7, 8), (7, 8, 9), ())
    assert layout.verifies and not VerifyLayout.of([None, None]).verifies
    assert layout.run_starts() == [0, 1, 1, 1, 1, 5]
    # Row 1's token must equal 7 for row 2 to be kept, and so on; the last row of a run decides nothing.
    assert layout.kept_pairs() == ([1, 2, 3], [7, 8, 9])
    # Counts of the proposals before each of the rows 3, 0 and 4 (indexed 0, 1, 2 among them).
    assert layout.draft_pairs([3, 0, 4]) == ([0, 0, 2, 2, 2], [7, 8, 7, 8, 9])
    # Two verifications back to back stay apart.
    assert VerifyLayout.of([(4,), (5, 6)]).kept_pairs() == ([0, 2, 3], [4, 5, 6])


@pytest.mark.parametrize("seed", range(6))
def test_the_kept_rows_on_the_device_are_the_ones_the_acceptance_rule_keeps(seed):
    import random

    from stage_worker.sampling.row_options import kept_rows

    rng = random.Random(seed)
    runs = [None if rng.random() < 0.3 else tuple(rng.randrange(3) for _ in range(rng.randrange(1, 5)))
            for _ in range(5)]
    layout = VerifyLayout.of(runs)
    tokens = [rng.randrange(3) for _ in layout.preceding]
    expected, row = [], 0
    for drafts in runs:
        rows = 1 if drafts is None else len(drafts) + 1
        kept = 1 if drafts is None else len(accept_proposals(tokens[row:row + rows], drafts))
        expected += [1.0] * kept + [0.0] * (rows - kept)
        row += rows
    assert kept_rows(mx.array(tokens, mx.int32), layout).tolist() == expected


# -- who speculates ----------------------------------------------------------------------------------------------
def test_the_rule_turns_speculation_off_where_it_cannot_pay():
    def k(**given):
        args = {"running": 1, "remaining": 100, "budget": 512, "acceptance": Acceptance()}
        return speculative_tokens(NGRAM, **{**args, **given})

    assert k() == 3
    assert speculative_tokens(None, running=1, remaining=9, budget=9, acceptance=Acceptance()) == 0
    limit = NGRAM.limit_for(None)
    assert k(running=limit + 1) == 0 and k(running=limit) == 3
    assert k(remaining=3) == 2 and k(remaining=1) == 0  # room for the bonus token within max_tokens
    assert k(budget=2) == 1
    assert k(acceptance=Acceptance(paused_steps=2)) == 0


def test_a_sequence_whose_proposals_keep_failing_pauses_then_tries_again():
    one_miss = Acceptance().after_verification(0)
    assert not one_miss.paused_steps  # one miss is not enough evidence
    acceptance = one_miss.after_verification(0)
    assert acceptance.paused_steps == PAUSE_STEPS
    for _ in range(PAUSE_STEPS):
        acceptance = acceptance.after_plain_step()
    assert acceptance == Acceptance()  # afresh
    assert not Acceptance().after_verification(3).after_verification(0).paused_steps  # 1.5 of 1.5 recent
    assert Acceptance().after_verification(1).after_verification(0).paused_steps  # 0.5 of 1.5 recent


# -- the scheduler ----------------------------------------------------------------------------------------------
def _scheduler(**given) -> Scheduler:
    return Scheduler(max_num_seqs=4, max_model_len=64, max_waiting=4, speculative=NGRAM, **given)


def _prefilled(s: Scheduler, prompt, max_tokens: int, first: int, stop=frozenset()):
    s.add(GenerationRequest("r", tuple(prompt), max_tokens, stop_token_ids=frozenset(stop)))
    batch = s.next_batch()
    (chunk,) = batch.chunks
    s.on_sampled(batch, [SampledToken(chunk.record.seq_id, len(prompt), first)])
    return chunk.record.seq_id


def test_a_speculating_sequence_sends_its_token_and_proposals_as_one_verification():
    s = _scheduler()
    seq_id = _prefilled(s, [1, 2, 3, 1, 2], 10, first=3)
    batch = s.next_batch()
    (chunk,) = batch.chunks
    assert chunk.record.flags == RecordFlag.SAMPLE | RecordFlag.VERIFY
    assert chunk.record.start_pos == 5 and chunk.token_ids == (3, 1, 2, 3)
    assert s.continuation(batch).chunks == ()  # a verification is never continued
    # The target agrees with two proposals, then differs: three tokens in one event; the next step starts
    # right after them (stages drop the rejected position).
    kept = [SampledToken(seq_id, 6 + i, t) for i, t in enumerate((1, 2, 9))]
    (event,) = s.on_sampled(batch, kept)
    assert event.token_ids == (1, 2, 9) and event.completion_tokens == 4 and event.finish is None
    (next_chunk,) = s.next_batch().chunks
    assert next_chunk.record.start_pos == 8 and next_chunk.token_ids[0] == 9
    assert s.spec_decode.counts.draft_tokens == 3 and s.spec_decode.counts.accepted_tokens == 2


def test_max_tokens_and_stop_tokens_cut_an_accepted_run_where_decoding_would_stop():
    s = _scheduler()
    seq_id = _prefilled(s, [1, 2, 3, 1, 2], 3, first=3)
    batch = s.next_batch()
    (chunk,) = batch.chunks
    assert chunk.token_ids == (3, 1)  # room for one proposal and the bonus token within max_tokens 3
    (event,) = s.on_sampled(batch, [SampledToken(seq_id, 6, 1), SampledToken(seq_id, 7, 2)])
    assert event.token_ids == (1, 2) and event.finish == Finish.LENGTH

    s = _scheduler()
    seq_id = _prefilled(s, [1, 2, 3, 1, 2], 10, first=3, stop={2})
    batch = s.next_batch()
    (event,) = s.on_sampled(batch, [SampledToken(seq_id, 6 + i, t) for i, t in enumerate((1, 2, 3, 1))])
    assert event.token_ids == (1, 2) and event.finish == Finish.STOP


def test_a_sequence_with_any_request_option_speculates():
    sampling = SamplingParams(temperature=0.5, seed=1, logprobs=1, presence_penalty=0.5, logit_bias=((3, 1.0),),
                              min_p=0.1, min_tokens=2, grammar="x")
    s = _scheduler()
    s.add(GenerationRequest("r", (1, 2, 3, 1, 2), 10, sampling=sampling))
    batch = s.next_batch()
    s.on_sampled(batch, [SampledToken(batch.chunks[0].record.seq_id, 5, 3)])
    (chunk,) = s.next_batch().chunks
    assert chunk.record.flags == RecordFlag.SAMPLE | RecordFlag.VERIFY and chunk.token_ids == (3, 1, 2, 3)


# -- a stage's KV --------------------------------------------------------------------------------------------------
def _kv(seq_ids, length: int) -> KVStore:
    def caches():
        return [KVCache()]

    store = KVStore(caches, 8)
    for seq_id in seq_ids:
        (cache,) = store.for_chunk(seq_id, 0, True, length)
        keys = mx.full((1, 1, length, 2), 10.0 * seq_id)
        cache.update_and_fetch(keys, keys)
    return store


def test_a_record_starting_before_the_kv_end_drops_the_positions_after_it():
    store = _kv([1], 6)
    (cache,) = store.for_chunk(1, 4, False, 3, verify=True)  # positions 6.. were rejected: back to 4
    assert cache.offset == 4 and store.tokens_held == 7
    with pytest.raises(WireMismatchError, match="continues at position 9"):
        store.for_chunk(1, 9, False, 1)  # ahead of the KV is still a lost message


def test_a_grouped_sequence_drops_positions_without_leaving_its_group():
    store = _kv([1, 2], 5)
    (group,) = store.for_decode([1, 2], [5, 5])  # both in one decode group, 6 positions each
    step = mx.full((2, 1, 1, 2), 0.5)
    group.update_and_fetch(step, step)  # what the stage's forward writes
    assert store.for_decode([1, 2], [4, 6]) == [group]  # sequence 1 rolls back two positions, in place
    group.update_and_fetch(step, step)
    assert group.offset.tolist() == [5, 7] and store.tokens_held == 12
    # Sequence 1 holds its first 4 positions and the new one; sequence 2 all of its 7.
    assert group.keys[0, 0, group._idx - 5:group._idx, 0].tolist() == [10.0] * 4 + [0.5]
    assert group.keys[1, 0, group._idx - 7:group._idx, 0].tolist() == [20.0] * 5 + [0.5, 0.5]


def test_an_abort_during_a_verification_drops_its_tokens_and_frees_the_kv():
    s = _scheduler()
    seq_id = _prefilled(s, [1, 2, 3, 1, 2], 10, first=3)
    batch = s.next_batch()
    assert batch.chunks[0].record.has(RecordFlag.VERIFY)
    (final,) = [s.abort("r")]
    assert final is not None and final.finish == Finish.ABORT
    assert s.on_sampled(batch, [SampledToken(seq_id, 6 + i, t) for i, t in enumerate((1, 2, 3, 1))]) == []
    (release,) = s.next_batch().chunks
    assert release.record.has(RecordFlag.RELEASE) and release.record.seq_id == seq_id

