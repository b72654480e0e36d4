"""``bench speculative --pp``'s pure parts: the counters read from ``/mesh`` and what an arm added."""

from stagemesh.bench.speculative_served import counts_between, spec_counts


def _mesh(*stages: dict) -> dict:
    return {"replicas": [{"replica": 0, "stages": [{"rank": i, "stats": s} for i, s in enumerate(stages)]}]}


def test_the_entry_stages_counters_are_summed_and_missing_ones_read_zero():
    mesh = _mesh({"spec_decode_num_drafts": 3, "spec_decode_num_draft_tokens": 12,
                  "spec_decode_num_accepted_tokens": 5}, {})
    assert spec_counts(mesh) == {"drafts": 3, "draft_tokens": 12, "accepted_tokens": 5}
    assert spec_counts({}) == {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}


def test_an_arms_figures_are_what_it_added_to_the_counters():
    before = {"drafts": 3, "draft_tokens": 12, "accepted_tokens": 5}
    after = {"drafts": 13, "draft_tokens": 52, "accepted_tokens": 25}
    assert counts_between(before, after) == {
        "acceptance_rate": 0.5, "tokens_per_verification": 3.0,
        "spec_decode": {"drafts": 10, "draft_tokens": 40, "accepted_tokens": 20}}
    assert counts_between(before, before) == {}  # nothing verified: the off arm reports no acceptance
