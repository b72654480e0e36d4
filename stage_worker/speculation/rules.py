"""Speculative decoding's decisions and bookkeeping, as pure functions and plain values (no MLX, no I/O).

- ``speculative_tokens`` is the one rule for which sequences speculate in a step, and with how many
  proposals; ``Acceptance`` is a sequence's recent record, which pauses it while its proposals do not pay.
- ``accept_proposals`` is the last stage's rule for what a verification keeps: the output is the one without
  speculation, token for token, greedy or seeded. ``VerifyLayout`` lays out a batch's verification rows so
  each row is processed as the sequence's row at that position would be without speculation.
- ``drafts_body`` / ``drafts_from_body`` carry the draft ids to the last stage in the FORWARD body.
- A ``Proposer`` proposes, asked with a ``ProposalAsk`` per sequence: prompt lookup
  (``ngram_proposer.NgramProposer``) or a draft model (``draft_proposer.DraftProposer``).
- ``SpecDecodeCounter`` counts what vLLM's ``spec_decode_*`` metrics report: verifications (drafts), draft
  tokens, accepted tokens, and accepted tokens per position.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from stagemesh_core.speculative import MAX_SPECULATIVE_TOKENS, SpeculativeConfig

# A verification costs more rows through the same weights than a plain step and yields its accepted tokens
# plus one: on a CPU it does not pay below half a token accepted per verification (docs/performance.md,
# "Speculative decoding", has the figures). Across stages the extra rows cost still less against the trip.
MIN_ACCEPTED_PER_VERIFICATION = 0.5
MIN_EVIDENCE_VERIFICATIONS = 1.5  # two verifications in a row, decayed, before the rate is trusted
PAUSE_STEPS = 8  # decode steps a sequence below the rate runs without proposals


@dataclass(frozen=True)
class Acceptance:
    """A sequence's recent verifications and accepted tokens (decayed sums) and the plain steps it still
    waits before proposing again.

    Both sums are halved at every verification so recent steps count most. Below
    ``MIN_ACCEPTED_PER_VERIFICATION`` accepted tokens per verification (over at least two in a row) the
    sequence pauses for ``PAUSE_STEPS`` decode steps, then tries afresh."""

    verifications: float = 0.0
    accepted: float = 0.0
    paused_steps: int = 0

    @property
    def accepted_per_verification(self) -> float:
        return self.accepted / self.verifications if self.verifications else 0.0

    def after_verification(self, accepted: int) -> Acceptance:
        recent = Acceptance(self.verifications / 2 + 1, self.accepted / 2 + accepted)
        if recent.verifications >= MIN_EVIDENCE_VERIFICATIONS and \
                recent.accepted_per_verification < MIN_ACCEPTED_PER_VERIFICATION:
            return Acceptance(paused_steps=PAUSE_STEPS)
        return recent

    def after_plain_step(self) -> Acceptance:
        return replace(self, paused_steps=self.paused_steps - 1) if self.paused_steps else self


@dataclass(frozen=True)
class ProposalAsk:
    """One sequence's share of a step's proposals: its tokens so far (prompt, then generated) and at most
    how many proposals it may have."""

    seq_id: int
    tokens: tuple[int, ...]
    k: int


class Proposer(Protocol):
    """Who proposes: asked once per step for every sequence ``speculative_tokens`` lets speculate, told when
    a sequence leaves (``release``) or every sequence does (``clear``). Prompt lookup
    (``ngram_proposer.NgramProposer``) is pure; a draft model (``draft_proposer.DraftProposer``) runs on the
    entry stage's model thread, which is the thread calling the scheduler."""

    def propose(self, asks: Sequence[ProposalAsk]) -> dict[int, tuple[int, ...]]:
        """Up to ``ask.k`` proposed next tokens for each ask's sequence, by seq_id (missing or empty: none)."""
        ...

    def release(self, seq_id: int) -> None:
        """The sequence left (finished, aborted): forget what is kept for it."""
        ...

    def clear(self) -> None:
        """Every sequence left (the pipeline broke)."""
        ...


def speculative_tokens(config: SpeculativeConfig | None, *, running: int, remaining: int, budget: int,
                       acceptance: Acceptance) -> int:
    """How many proposals a sequence may have verified this step (0: a plain decode step).

    Every request option is honoured exactly (``accept_proposals``), so a sequence proposes whenever no more
    than ``disable_by_batch_size`` sequences run, its ``Acceptance`` has not paused it, and it may still
    produce at least two tokens; it asks for at most as many proposals as leave room for the bonus token.

    ``remaining``: tokens it may still produce (by max_tokens and the model length); ``budget``: token rows
    left in the batch. A verification of k proposals yields up to k + 1 tokens and feeds k + 1 rows.
    """
    if config is None or running > config.limit_for(None) or acceptance.paused_steps:
        return 0
    return max(0, min(config.num_speculative_tokens, remaining - 1, budget - 1))


def accept_proposals(targets: Sequence[int], drafts: Sequence[int]) -> tuple[int, ...]:
    """The tokens a verification keeps: ``targets[i]`` is the target's token after the first i drafts.

    The target's tokens are kept while each equals the next draft, plus the one after the last match (1..k+1
    tokens). The target's token at each row is what the sequence would have got there without speculation:
    the argmax, or a draw keyed by the request's (seed, position) as every sampled row is
    (``sampling.sample_rows``), so the output is the one without speculation, token for token. For a proposer
    as sure of its proposal as prompt lookup, this is the standard rejection rule too: a proposal x is kept
    with probability p(x) under the target's filtered distribution, and a rejected row's token is drawn from
    p without x."""
    if len(targets) != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} target tokens, got {len(targets)}")
    accepted: list[int] = []
    for target, draft in zip(targets, drafts):
        accepted.append(int(target))
        if target != draft:
            return tuple(accepted)
    accepted.append(int(targets[-1]))
    return tuple(accepted)


@dataclass(frozen=True)
class VerifyLayout:
    """A batch's sampled rows, in order, as a verification sees them: ``preceding[r]`` holds the proposals row
    r's sequence is taken to have generated before it (row i of a verification: its first i proposals; any other
    sampled row: none).

    Row i of a verification is processed as if its first i proposals had been generated: the penalties count
    them, the grammar's mask is the one after them, min_tokens counts them by position; logprobs are each
    row's own. Only the kept rows count afterwards (``kept_pairs``)."""

    preceding: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, runs: Sequence[Sequence[int] | None]) -> VerifyLayout:
        """Per sampled record in row order: its proposals (a verification, 1 + k rows), or None (one row)."""
        preceding: list[tuple[int, ...]] = []
        for drafts in runs:
            if drafts is None:
                preceding.append(())
            else:
                preceding += [tuple(int(t) for t in drafts[:i]) for i in range(len(drafts) + 1)]
        return cls(tuple(preceding))

    @property
    def verifies(self) -> bool:
        return any(self.preceding)

    def draft_pairs(self, rows: Sequence[int]) -> tuple[list[int], list[int]]:
        """For the batch rows ``rows`` (in that order): (index into ``rows``, token) once per proposal before
        each, so one scatter-add of ones gives every row's counts of the proposals before it."""
        at: list[int] = []
        tokens: list[int] = []
        for i, row in enumerate(rows):
            at += [i] * len(self.preceding[row])
            tokens += self.preceding[row]
        return at, tokens

    def kept_pairs(self) -> tuple[list[int], list[int]]:
        """What decides which rows a verification keeps, as (row, proposal) pairs: each row r followed by
        another row of its verification, with the proposal its target token must equal for that row to be
        kept. Row r is kept iff every pair of its verification before r matched (``accept_proposals``)."""
        rows: list[int] = []
        proposals: list[int] = []
        for row in range(len(self.preceding) - 1):
            after = self.preceding[row + 1]
            if after and after[:-1] == self.preceding[row]:
                rows.append(row)
                proposals.append(after[-1])
        return rows, proposals

    def run_starts(self) -> list[int]:
        """Each row's verification's first row (a row outside one: itself)."""
        starts: list[int] = []
        for row, before in enumerate(self.preceding):
            starts.append(row - len(before))
        return starts


def drafts_body(drafts: Mapping[int, Sequence[int]]) -> dict[str, Any] | None:
    """The FORWARD body's share for verifying sequences (None: none verify): the draft ids travel to the last
    stage next to the ``RowOptions`` the body announces; every stage in between passes the body on."""
    if not drafts:
        return None
    return {"drafts": {str(seq_id): [int(t) for t in ids] for seq_id, ids in drafts.items()}}


def drafts_from_body(body: Mapping[str, Any] | None) -> dict[int, tuple[int, ...]]:
    if not body or "drafts" not in body:
        return {}
    return {int(seq_id): tuple(int(t) for t in ids) for seq_id, ids in body["drafts"].items()}


@dataclass(frozen=True)
class SpecDecodeCounts:
    """What speculation did, all time (vLLM's ``spec_decode_*`` counters)."""

    drafts: int = 0  # verifications
    draft_tokens: int = 0
    accepted_tokens: int = 0  # draft tokens the target agreed with (bonus tokens not counted, as vLLM)
    accepted_per_position: tuple[int, ...] = ()  # [i]: verifications whose draft i was accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0


class SpecDecodeCounter:
    """The running counts over ``positions`` proposal positions; ``counts`` is a frozen copy another thread
    can read."""

    def __init__(self, positions: int = MAX_SPECULATIVE_TOKENS) -> None:
        self.counts = SpecDecodeCounts(accepted_per_position=(0,) * positions)

    def record(self, drafted: int, accepted: int) -> None:
        per_position = list(self.counts.accepted_per_position)
        for position in range(accepted):
            per_position[position] += 1
        c = self.counts
        self.counts = SpecDecodeCounts(c.drafts + 1, c.draft_tokens + drafted, c.accepted_tokens + accepted,
                                       tuple(per_position))


__all__ = ["Acceptance", "ProposalAsk", "Proposer", "SpecDecodeCounter", "SpecDecodeCounts", "VerifyLayout",
           "accept_proposals", "drafts_body", "drafts_from_body", "speculative_tokens"]
