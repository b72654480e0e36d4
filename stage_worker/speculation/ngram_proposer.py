"""Prompt lookup (vLLM's ``ngram`` method): proposals for a sequence's next tokens from its own past.

Contract: ``propose_ngram(tokens, k, min_n, max_n)`` is pure. Over a sequence's tokens (prompt, then what
was generated) it finds the longest suffix, of ``max_n`` down to ``min_n`` tokens, that also occurs earlier in
the sequence, and proposes the ``k`` tokens that followed its most recent earlier occurrence; none where no
such suffix recurs. ``NgramProposer`` is the method as a ``speculation.Proposer``: it keeps nothing
per sequence. Where those tokens run past the end of the sequence (the occurrence overlaps the suffix,
as in a loop), the copy goes on over the tokens it proposes, as LZ77's overlapping copies do: a sequence
looping with period p gets k proposals that go on looping, not just the p tokens it holds.
"""

from __future__ import annotations

from collections.abc import Sequence

from stage_worker.speculation.rules import ProposalAsk


def propose_ngram(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> tuple[int, ...]:
    if k < 1 or min_n < 1 or max_n < min_n:
        raise ValueError(f"k >= 1 and 1 <= min_n <= max_n, got k={k}, min_n={min_n}, max_n={max_n}")
    seq = list(tokens)
    length = len(seq)
    limit = min(max_n, length - 1)  # an earlier occurrence ends before the last token
    if limit < min_n:
        return ()
    # One pass from the most recent end backwards: at each earlier position ending like the sequence does,
    # how many tokens back it keeps matching the sequence's suffix (up to ``limit``). The first position to
    # reach a length is the most recent occurrence of that suffix; only a longer match replaces it.
    last = seq[-1]
    best_len, best_end = 0, -1
    for end in range(length - 2, -1, -1):
        if seq[end] != last:
            continue
        matched = 1
        while matched < limit and matched <= end and seq[end - matched] == seq[length - 1 - matched]:
            matched += 1
        if matched > best_len:
            best_len, best_end = matched, end
            if matched == limit:
                break
    if best_len < min_n:
        return ()
    follow = best_end + 1
    proposals = seq[follow:follow + k]
    period = length - follow  # the tokens after the occurrence; beyond them the copy repeats itself
    while len(proposals) < k:
        proposals.append(proposals[len(proposals) - period])
    return tuple(proposals)


class NgramProposer:
    """Prompt lookup over each sequence's own tokens (``propose_ngram``), lookup bounds ``min_n``..``max_n``."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, asks: Sequence[ProposalAsk]) -> dict[int, tuple[int, ...]]:
        return {ask.seq_id: propose_ngram(ask.tokens, ask.k, self.min_n, self.max_n) for ask in asks}

    def release(self, seq_id: int) -> None:
        pass  # nothing kept per sequence

    def clear(self) -> None:
        pass


__all__ = ["NgramProposer", "propose_ngram"]
