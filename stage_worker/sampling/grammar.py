"""Constrained decoding on the last stage: one llguidance matcher per constrained sequence.

Contract:
- ``GrammarRows(spec)`` holds an ``llguidance.LLMatcher`` per sequence whose ``RowOptions.sampling.grammar`` is
  set (an llguidance grammar: the gateway compiles JSON schemas, regexes and Lark into it); stages that never
  see a constrained sequence never load llguidance or the tokenizer.
- ``masks(seq_ids, vocab)`` gives every constrained row's allowed tokens as an ``int32[k, ceil(vocab/32)]``
  bitmask, a speculative verification's rows included, the matchers left as they were; ``apply(logits,
  bitmask)`` sets every other token's logit to -inf on the device.
- Where the grammar allows ending, the request's stop tokens are allowed too; a matcher that finished or failed
  allows only the stop tokens, so the sequence ends instead of sampling from nothing.
- ``accept(seq_id, token)`` advances a matcher with a token the sequence kept.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from stage_worker.checkpoint.model_spec import ModelSpec

log = logging.getLogger(__name__)


class GrammarRows:
    """The llguidance matchers of a last stage's constrained sequences, by sequence id."""

    def __init__(self, spec: ModelSpec) -> None:
        self._spec = spec
        self._tokenizer: Any = None
        self._executor: Any = None
        self._eos: int | None = None
        self._matchers: dict[int, Any] = {}
        self._stops: dict[int, tuple[int, ...]] = {}

    def __len__(self) -> int:
        return len(self._matchers)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._matchers

    def _load(self, vocab: int) -> None:
        """Build the llguidance tokenizer from the model's own tokenizer, once per stage process."""
        if self._tokenizer is not None:
            return
        # llguidance and the tokenizer (transformers) load only for a stage's first constrained sequence.
        import llguidance
        import llguidance.hf

        from stage_worker.checkpoint.tokenizer import load_tokenizer

        hf = load_tokenizer(self._spec)
        self._eos = hf.eos_token_id
        self._tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
        self._executor = llguidance.LLExecutor()
        log.info("constrained decoding: llguidance tokenizer built (%d tokens)", vocab)

    def add(self, seq_id: int, grammar: str, stop_token_ids: Sequence[int], vocab: int) -> None:
        import llguidance

        self._load(vocab)
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():  # the gateway validated it; a stage-level failure still must not hang the row
            log.warning("sequence %d: grammar rejected: %s", seq_id, matcher.get_error())
        self._matchers[seq_id] = matcher
        self._stops[seq_id] = tuple(stop_token_ids)

    def release(self, seq_ids: Sequence[int]) -> None:
        for seq_id in seq_ids:
            self._matchers.pop(seq_id, None)
            self._stops.pop(seq_id, None)

    def masks(self, seq_ids: Sequence[int], vocab: int,
              preceding: Sequence[Sequence[int]] | None = None) -> np.ndarray:
        """``int32[len(seq_ids), words]`` allowed-token bitmask of each constrained row: after the proposals
        ``preceding[i]`` (a verification's row; none for any other row), the matchers left as they were.
        A sequence's rows come in order of their proposals, each a prefix of the next.

        The masks are computed in llguidance's thread pool (``LLExecutor``: Rust, the GIL released). For a
        verification it advances each matcher through its proposals, one mask per proposal prefix (every row
        of a depth in one parallel call), then rolls the matcher back (``LLMatcher.rollback``). A proposal the
        mask before it does not allow (or a stop token, which ends the sequence) ends the useful rows: the
        target's token there differs from it, so no later row is ever kept; those rows get an all-allowed mask.
        """
        bitmask = allocate_token_bitmask(len(seq_ids), vocab)  # all allowed: rows past a refused proposal
        preceding = preceding if preceding is not None else [()] * len(seq_ids)
        consumed: dict[int, int] = {}  # proposals each matcher went through, to roll back
        ended: set[int] = set()  # sequences whose proposals left their grammar or stopped it
        try:
            for depth in sorted({len(p) for p in preceding}):
                rows = []
                for i, (seq_id, before) in enumerate(zip(seq_ids, preceding, strict=True)):
                    if len(before) != depth or seq_id in ended:
                        continue
                    while consumed.get(seq_id, 0) < depth:
                        if not self._try_proposal(seq_id, before[consumed.get(seq_id, 0)]):
                            ended.add(seq_id)
                            break
                        consumed[seq_id] = consumed.get(seq_id, 0) + 1
                    if seq_id not in ended:
                        rows.append(i)
                self._fill(bitmask, [seq_ids[i] for i in rows], rows)
        finally:
            for seq_id, n in consumed.items():
                if n:
                    self._matchers[seq_id].rollback(n)
        return bitmask

    def _try_proposal(self, seq_id: int, token: int) -> bool:
        """Advance a matcher through a proposal its grammar allows (False, unmoved: it does not, or the
        proposal would end the sequence)."""
        matcher = self._matchers[seq_id]
        if token in self._stops[seq_id] or matcher.is_stopped() or matcher.is_error():
            return False
        if matcher.validate_tokens([token]) != 1:
            return False
        return bool(matcher.consume_token(token))

    def _fill(self, bitmask: np.ndarray, seq_ids: Sequence[int], rows: Sequence[int]) -> None:
        """Each row's mask from its sequence's matcher as it stands (one row per matcher).

        llguidance only knows the tokenizer's EOS: where it allows EOS, the request's stop tokens are allowed
        too. A matcher that finished or failed allows only the stop tokens (a request that ignores EOS has
        none: its rows then allow only the tokenizer's EOS, until ``max_tokens``).
        """
        from llguidance.numpy import fill_next_token_bitmask_par

        live = [(self._matchers[s], i) for s, i in zip(seq_ids, rows, strict=True)
                if not (self._matchers[s].is_stopped() or self._matchers[s].is_error())]
        if live:
            fill_next_token_bitmask_par(self._executor, live, bitmask)
        live_rows = {i for _, i in live}
        for seq_id, i in zip(seq_ids, rows, strict=True):
            stops = self._stops[seq_id]
            if i not in live_rows:
                # A request that ignores EOS has no stop tokens: after its grammar it writes the tokenizer's EOS
                # until max_tokens, as it asked, rather than sampling from a row with nothing allowed.
                ending = stops or ((self._eos,) if self._eos is not None else ())
                if ending:
                    bitmask[i] = 0
                    _set_bits(bitmask[i], ending)
            elif self._eos is not None and _bit(bitmask[i], self._eos):
                _set_bits(bitmask[i], stops)  # the grammar may end here: so may the request's stop tokens

    def accept(self, seq_id: int, token: int) -> None:
        """Advance ``seq_id``'s matcher with a token the sequence kept: the last stage reads the sampled ids
        back anyway (to send them), so constrained sequences cost one host step per token, and nothing for the
        others."""
        matcher = self._matchers.get(seq_id)
        if matcher is None or matcher.is_stopped() or matcher.is_error():
            return
        if token in self._stops[seq_id] and matcher.is_accepting():
            token = self._eos if self._eos is not None else token
        if not matcher.consume_token(token):
            log.warning("sequence %d: token %d left its grammar: %s", seq_id, token, matcher.get_error())


def allocate_token_bitmask(rows: int, vocab: int) -> np.ndarray:
    """An all-allowed ``int32[rows, ceil(vocab/32)]`` bitmask (llguidance's layout)."""
    return np.full((rows, (vocab + 31) // 32), -1, dtype=np.int32)


def _bit(row: np.ndarray, token: int) -> bool:
    return bool((int(row[token // 32]) >> (token % 32)) & 1)


def _set_bits(row: np.ndarray, tokens: Sequence[int]) -> None:
    for token in tokens:
        if 0 <= token < row.size * 32:
            row[token // 32] = np.int32(np.uint32(int(row[token // 32]) & 0xFFFFFFFF | (1 << (token % 32)))
                                        .view(np.int32))


def apply(logits: mx.array, bitmask: np.ndarray) -> mx.array:
    """``logits[k, vocab]`` with the tokens ``bitmask`` does not allow at -inf (lazy, on the device): bit
    unpacking is one vectorized op, no per-row loop over the vocabulary on the host."""
    vocab = logits.shape[-1]
    token = mx.arange(vocab, dtype=mx.uint32)
    words = mx.array(bitmask.view(np.uint32))[:, token // 32]
    allowed = ((words >> (token % 32)) & 1).astype(mx.bool_)
    return mx.where(allowed, logits, -mx.inf)
