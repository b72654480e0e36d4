"""``stagemesh bench speculative``'s step breakdown: which kind of target step a batch is, the figures per kind
and per draft round, and the lines its text shows for them (pure; the bench's own run is the GPU's)."""

from __future__ import annotations

from stage_worker.batch import Chunk, RecordFlag, SequenceRecord
from stage_worker.speculation.draft_proposer import DraftTimings
from stagemesh.bench.speculative import StepTimes, draft_report, format_speculative, step_kind

SAMPLE = RecordFlag.SAMPLE


def chunk(seq_id: int, tokens: int, flags: RecordFlag = SAMPLE, start: int = 10) -> Chunk:
    return Chunk(SequenceRecord(seq_id, start, tokens, flags), tuple(range(tokens)))


def test_a_batch_is_a_verification_a_plain_step_or_a_prompt_step():
    release = Chunk(SequenceRecord(3, 12, 0, RecordFlag.RELEASE), ())
    assert step_kind([chunk(1, 1), chunk(2, 5, SAMPLE | RecordFlag.VERIFY), release]) == "verify"
    assert step_kind([chunk(1, 1), chunk(2, 1), release]) == "plain"
    assert step_kind([chunk(1, 1), chunk(2, 7, RecordFlag.NEW_SEQUENCE, start=0)]) == "prompt"
    assert step_kind([chunk(1, 1), chunk(2, 64, RecordFlag.NONE)]) == "prompt"  # a prompt's middle chunk
    assert step_kind([release]) is None  # feeds nothing: not a step


def test_step_times_and_draft_rounds_report_per_step_and_per_round():
    steps = StepTimes()
    steps.add("verify", 10, 0.3)
    steps.add("verify", 6, 0.1)
    steps.add("plain", 2, 0.05)
    assert steps.report() == {"verify": {"steps": 2, "rows_per_step": 8.0, "ms_per_step": 200.0},
                              "plain": {"steps": 1, "rows_per_step": 2.0, "ms_per_step": 50.0}}
    timings = DraftTimings(rounds=4, rows=8, catch_up_forwards=2, catch_up_tokens=12, regroup_s=0.004,
                           catch_up_s=0.008, steps_s=0.02, sync_s=0.2, host_s=0.002)
    report = draft_report(timings)
    assert report["rounds"] == 4 and report["rows_per_round"] == 2.0
    assert report["catch_up_forwards_per_round"] == 0.5 and report["catch_up_tokens_per_round"] == 3.0
    assert report["ms_per_round_by_phase"] == {"regroup": 1.0, "catch_up": 2.0, "steps": 5.0, "sync": 50.0,
                                               "host": 0.5}
    assert report["ms_per_round"] == 58.5


def test_the_text_shows_each_arms_target_steps_and_draft_rounds():
    target = {"plain": {"steps": 30, "rows_per_step": 1.0, "ms_per_step": 9.3}}
    on_target = {"verify": {"steps": 10, "rows_per_step": 5.0, "ms_per_step": 12.5}, **target}
    draft = draft_report(DraftTimings(rounds=10, rows=10, sync_s=0.1, steps_s=0.02))
    report = {"results": {"levels": [{"streams": 1,
                                      "off": {"tokens": 40, "tokens_per_s": 100.0, "target_steps": target},
                                      "on": {"tokens": 40, "tokens_per_s": 120.0, "acceptance_rate": 0.5,
                                             "tokens_per_verification": 3.0, "target_steps": on_target,
                                             "draft": draft}}]},
              "ratios": [{"streams": 1, "tokens_per_s": 1.2, "identical_greedy_tokens": True}]}
    text = format_speculative(report)
    assert "1 stream(s), off: target plain 9.3 ms x 30 (1 rows)" in text
    assert "1 stream(s), on: target verify 12.5 ms x 10 (5 rows), plain 9.3 ms x 30 (1 rows)" in text
    assert "1 stream(s), on: draft 12.0 ms per round x 10 (1 sequences" in text and "sync 10.00" in text
