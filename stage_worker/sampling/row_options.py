"""Per-sequence logits processing and logprobs on the last stage, batch-aware.

- A sequence's ``RowOptions`` (``stage_worker.batch``: its ``SamplingParams`` and the context its processors
  need) travel **once**, as JSON in the body of the FORWARD frame whose record starts the sequence
  (``rows_body`` / ``rows_from_body``); every stage but the last passes the body on untouched. A request the
  processors leave alone sends nothing.
- ``RowProcessors`` (one per last stage) keeps each such sequence's state on the device until its RELEASE:
  ``process`` gives the logits the sampler uses (mlx-lm's processor order, OpenAI's and vLLM's semantics),
  ``observe`` counts the sampled tokens, ``accept`` advances the grammars (``stage_worker.sampling.grammar``). A batch
  without such rows is returned untouched, and no per-row loop ever touches the vocabulary on the host.
- A verification's rows (``speculation.VerifyLayout``) are processed as if the sequence had generated the
  proposals before each.
- ``RowProcessors.logprobs`` is a lazy ``LogprobRows`` of the processed logits, sent back in the TOKENS body
  (``LogprobRows.to_body`` / ``logprobs_from_body``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from stage_worker.batch import RowOptions, TokenLogprob
from stage_worker.checkpoint.model_spec import ModelSpec
from stage_worker.sampling import grammar
from stage_worker.sampling.grammar import GrammarRows, allocate_token_bitmask
from stage_worker.speculation.rules import VerifyLayout


def rows_body(options: Mapping[int, RowOptions]) -> dict | None:
    """The FORWARD body announcing new sequences' options (None: nothing to announce)."""
    if not options:
        return None
    return {"rows": {str(seq_id): o.to_json() for seq_id, o in options.items()}}


def rows_from_body(body: Mapping | None) -> dict[int, RowOptions]:
    if not body or "rows" not in body:
        return {}
    return {int(seq_id): RowOptions.from_json(raw) for seq_id, raw in body["rows"].items()}


@dataclass(frozen=True)
class LogprobRows:
    """Lazy logprobs of some rows of a sampled batch (``rows`` index the batch's sampled records)."""

    rows: tuple[int, ...]
    top_counts: tuple[int, ...]
    chosen: mx.array  # float32 [len(rows)]
    top_ids: mx.array  # int32 [len(rows), k]
    top_values: mx.array  # float32 [len(rows), k]

    def arrays(self) -> list[mx.array]:
        return [self.chosen, self.top_ids, self.top_values]

    def read(self) -> dict[int, TokenLogprob]:
        """Batch row -> its logprobs (reads the arrays back: call after they were evaluated)."""
        chosen = np.array(self.chosen).tolist()
        ids = np.array(self.top_ids).tolist()
        values = np.array(self.top_values).tolist()
        return {row: TokenLogprob(chosen[i], tuple(zip(ids[i][:n], values[i][:n], strict=True)))
                for i, (row, n) in enumerate(zip(self.rows, self.top_counts, strict=True))}

    def to_body(self, seq_ids: Sequence[int], reply_rows: Sequence[int]) -> dict | None:
        """JSON for a TOKENS frame's body: by sequence id, one entry per replied token of its, in order.
        ``reply_rows``: the batch row of each token the reply holds; ``seq_ids``: each batch row's sequence."""
        out = self.read()
        by_seq: dict[str, list] = {}
        for row in reply_rows:
            lp = out.get(row)
            if lp is not None:
                by_seq.setdefault(str(seq_ids[row]), []).append([lp.logprob, [list(p) for p in lp.top]])
        return {"logprobs": by_seq} if by_seq else None


def logprobs_from_body(body: Mapping | None) -> dict[int, list[TokenLogprob]]:
    """Each sequence's logprobs, one per token the TOKENS reply holds for it, in order."""
    if not body or "logprobs" not in body:
        return {}
    return {int(seq_id): [TokenLogprob(float(v[0]), tuple((int(t), float(x)) for t, x in v[1])) for v in entries]
            for seq_id, entries in body["logprobs"].items()}


def kept_rows(tokens: mx.array, layout: VerifyLayout) -> mx.array:
    """``float32[n]`` (lazy): 1 for each sampled row a verification keeps and every row outside one, else 0.

    Row i of a verification is kept iff the tokens of its rows before i equal the proposals
    (``speculation.accept_proposals``): the mismatches before each row, counted from its verification's
    first row, are none."""
    rows, proposals = layout.kept_pairs()
    if not rows:
        return mx.ones(tokens.shape, mx.float32)
    index = mx.array(rows, mx.int32)
    mismatch = mx.zeros(tokens.shape, mx.int32).at[index].add(
        (tokens[index] != mx.array(proposals, mx.int32)).astype(mx.int32))
    before = mx.cumsum(mismatch) - mismatch  # mismatches in the rows before each row
    return (before == before[mx.array(layout.run_starts(), mx.int32)]).astype(mx.float32)


class _RowState:
    """One sequence's device-side processing state (built on its first sampled row)."""

    def __init__(self, options: RowOptions, vocab: int) -> None:
        self.options = options
        o = options.sampling
        self.counts: mx.array | None = mx.zeros((vocab,), mx.float32) if options.penalized else None
        self.prompt_seen: mx.array | None = None
        if o.repetition_penalty != 1.0 and options.prompt_token_ids:
            seen = np.zeros((vocab,), np.bool_)
            seen[[t for t in options.prompt_token_ids if 0 <= t < vocab]] = True
            self.prompt_seen = mx.array(seen)
        self.bias: mx.array | None = None
        if o.logit_bias or o.allowed_token_ids:
            bias = np.zeros((vocab,), np.float32)
            if o.allowed_token_ids:
                bias[:] = -np.inf
                bias[[t for t in o.allowed_token_ids if 0 <= t < vocab]] = 0.0
            for token, value in o.logit_bias:
                if 0 <= token < vocab:
                    bias[token] += value
            self.bias = mx.array(bias)
        self.stop_mask: mx.array | None = None
        if o.min_tokens > 0 and options.stop_token_ids:
            mask = np.zeros((vocab,), np.bool_)
            mask[[t for t in options.stop_token_ids if 0 <= t < vocab]] = True
            self.stop_mask = mx.array(mask)


class RowProcessors:
    """The last stage's per-sequence logits processors (see the module contract).

    Each sequence with options keeps on the device until its RELEASE: the counts of the tokens it generated
    (the last stage samples them, so it sees every one; nothing is re-sent per step), the prompt's token set
    (repetition penalty), a dense bias vector (logit bias and allowed tokens), the stop-token mask
    (min-tokens) and, for constrained decoding, an llguidance matcher (``stage_worker.sampling.grammar``)."""

    def __init__(self, spec: ModelSpec | None = None) -> None:
        self._spec = spec  # the model's, for the grammar's tokenizer
        self._options: dict[int, RowOptions] = {}
        self._states: dict[int, _RowState] = {}
        self._pending: list[mx.array] = []
        self._grammars: GrammarRows | None = None

    @property
    def has_grammar(self) -> bool:
        return self._grammars is not None and len(self._grammars) > 0

    def accept(self, seq_ids: Sequence[int], token_ids: Sequence[int]) -> None:
        """Advance the grammars of constrained rows with their kept tokens (host ids, in order), once they are
        on the host (``has_grammar`` says whether any row needs that)."""
        if self._grammars is None:
            return
        for seq_id, token in zip(seq_ids, token_ids, strict=True):
            if seq_id in self._grammars:
                self._grammars.accept(seq_id, token)

    def register(self, options: Mapping[int, RowOptions]) -> None:
        for seq_id, o in options.items():
            if not o.is_default:
                self._options[seq_id] = o
                self._states.pop(seq_id, None)

    def release(self, seq_ids: Sequence[int]) -> None:
        for seq_id in seq_ids:
            self._options.pop(seq_id, None)
            self._states.pop(seq_id, None)
        if self._grammars is not None:
            self._grammars.release(seq_ids)

    def __len__(self) -> int:
        return len(self._options)

    def min_ps(self, seq_ids: Sequence[int]) -> list[float] | None:
        if not self._options:
            return None
        values = [o.sampling.min_p if (o := self._options.get(s)) is not None else 0.0 for s in seq_ids]
        return values if any(values) else None

    def _state(self, seq_id: int, vocab: int) -> _RowState | None:
        o = self._options.get(seq_id)
        if o is None or not o.transforms_logits:
            return None
        state = self._states.get(seq_id)
        if state is None:
            state = self._states[seq_id] = _RowState(o, vocab)
            if o.sampling.grammar:
                if self._grammars is None:
                    if self._spec is None:
                        raise ValueError("constrained decoding needs the model's tokenizer (RowProcessors(spec))")
                    self._grammars = GrammarRows(self._spec)
                self._grammars.add(seq_id, o.sampling.grammar, o.stop_token_ids, vocab)
        return state

    def process(self, logits: mx.array, seq_ids: Sequence[int], positions: Sequence[int],
                layout: VerifyLayout | None = None) -> mx.array:
        """``float32[k, vocab]`` -> the processed logits (the same array when no row has state).

        ``positions``: the position each row's token takes; ``layout``: the proposals before each row (None:
        no verification in the batch).

        For the rows with state, in this order (mlx-lm's ``make_logits_processors`` order): bias (logit_bias,
        and -inf outside allowed_token_ids), the stop tokens masked to -inf while fewer than ``min_tokens``
        were generated, the repetition penalty over prompt and output tokens, the presence penalty and the
        frequency penalty over output tokens (OpenAI's and vLLM's semantics), then the grammar's token mask.
        All rows with state are processed together as one ``[k, vocab]`` gather and one scatter (no op, no
        sync without such rows). Row i of a verification is processed as if the sequence had generated its
        first i proposals: they add to the penalties' counts (one scatter-add of the proposals before each
        row), the grammar's mask is the one after them (``GrammarRows.masks``), and min_tokens counts them
        (by position)."""
        if not self._options:
            return logits
        vocab = logits.shape[-1]
        rows: list[int] = []
        states: list[_RowState] = []
        for i, seq_id in enumerate(seq_ids):
            state = self._state(seq_id, vocab)
            if state is not None:
                rows.append(i)
                states.append(state)
        if not rows:
            return logits
        index = mx.array(rows, mx.int32)
        sub = logits[index]
        zeros = mx.zeros((vocab,), mx.float32)
        if any(s.bias is not None for s in states):
            sub = sub + mx.stack([s.bias if s.bias is not None else zeros for s in states])
        masking = [s.stop_mask is not None and positions[r] - s.options.prompt_len < s.options.sampling.min_tokens
                   for r, s in zip(rows, states, strict=True)]
        if any(masking):
            no_stop = mx.zeros((vocab,), mx.bool_)
            mask = mx.stack([s.stop_mask if m and s.stop_mask is not None else no_stop
                             for s, m in zip(states, masking, strict=True)])
            sub = mx.where(mask, -mx.inf, sub)
        if any(s.counts is not None for s in states):
            counts = mx.stack([s.counts if s.counts is not None else zeros for s in states])
            at, drafted = layout.draft_pairs(rows) if layout is not None else ([], [])
            if at:  # a verification's rows: as if the proposals before each had been generated
                counts = counts.at[mx.array(at, mx.int32), mx.array(drafted, mx.int32)].add(1.0)
            sub = _penalize(sub, states, counts)
        if self._grammars is not None and any(s.options.sampling.grammar for s in states):
            constrained = [i for i, s in enumerate(states) if s.options.sampling.grammar]
            bitmask = allocate_token_bitmask(len(states), vocab)  # all allowed for the other rows
            preceding = [layout.preceding[rows[i]] if layout is not None else () for i in constrained]
            bitmask[constrained] = self._grammars.masks([seq_ids[rows[i]] for i in constrained], vocab, preceding)
            sub = grammar.apply(sub, bitmask)
        logits[index] = sub
        return logits

    def observe(self, seq_ids: Sequence[int], tokens: mx.array, layout: VerifyLayout | None = None) -> None:
        """Count each penalized sequence's sampled tokens, of a verification only those it keeps (lazy;
        ``pending`` holds what to evaluate). The kept rows (``kept_rows``) are known on the device from the
        tokens and the proposals, no sync."""
        if not self._states:
            return
        rows_of: dict[int, list[int]] = {}
        for i, seq_id in enumerate(seq_ids):
            state = self._states.get(seq_id)
            if state is not None and state.counts is not None:
                rows_of.setdefault(seq_id, []).append(i)
        if not rows_of:
            return
        kept = kept_rows(tokens, layout) if layout is not None and layout.verifies else None
        for seq_id, rows in rows_of.items():
            state = self._states[seq_id]
            assert state.counts is not None
            if len(rows) == 1:
                state.counts = state.counts.at[tokens[rows[0]]].add(1.0)
            else:
                index = mx.array(rows, mx.int32)
                weights = kept[index] if kept is not None else mx.ones((len(rows),), mx.float32)
                state.counts = state.counts.at[tokens[index]].add(weights)
            self._pending.append(state.counts)

    def pending(self) -> list[mx.array]:
        """What the caller must evaluate with the tokens, so the graph never grows across steps."""
        out, self._pending = self._pending, []
        return out

    def logprobs(self, logits: mx.array, tokens: mx.array, seq_ids: Sequence[int]) -> LogprobRows | None:
        """Lazy logprobs for the rows that asked (every row of a verification: each kept token reports its own
        row's): the log-softmax of the processed logits (before temperature and the top-k / top-p / min-p
        filters) at the chosen token and the top N. They travel back in the TOKENS body, one entry per token
        the reply holds, in order."""
        if not self._options:
            return None
        rows, counts = [], []
        for i, seq_id in enumerate(seq_ids):
            o = self._options.get(seq_id)
            if o is not None and o.sampling.logprobs is not None:
                rows.append(i)
                counts.append(o.sampling.logprobs)
        if not rows:
            return None
        index = mx.array(rows, mx.int32)
        sub = logits[index]
        logprobs = sub - mx.logsumexp(sub, axis=-1, keepdims=True)
        chosen = mx.take_along_axis(logprobs, tokens[index][:, None].astype(mx.int32), axis=-1)[:, 0]
        k = max(1, max(counts))
        top_ids = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[:, :k]
        top_values = mx.take_along_axis(logprobs, top_ids, axis=-1)
        order = mx.argsort(-top_values, axis=-1)
        top_ids = mx.take_along_axis(top_ids, order, axis=-1).astype(mx.int32)
        top_values = mx.take_along_axis(top_values, order, axis=-1)
        return LogprobRows(tuple(rows), tuple(counts), chosen, top_ids, top_values)


def _penalize(sub: mx.array, states: Sequence[_RowState], counts: mx.array) -> mx.array:
    """Repetition, presence and frequency penalties for the rows of ``sub`` (vLLM's definitions), given each
    row's counts of the tokens generated before it."""
    generated = counts > 0
    repetition = [s.options.sampling.repetition_penalty for s in states]
    if any(r != 1.0 for r in repetition):
        no_prompt = mx.zeros(counts.shape[-1:], mx.bool_)
        seen = generated | mx.stack([s.prompt_seen if s.prompt_seen is not None else no_prompt for s in states])
        penalty = mx.array(repetition, mx.float32)[:, None]
        sub = mx.where(seen, mx.where(sub < 0, sub * penalty, sub / penalty), sub)
    presence = mx.array([s.options.sampling.presence_penalty for s in states], mx.float32)[:, None]
    frequency = mx.array([s.options.sampling.frequency_penalty for s in states], mx.float32)[:, None]
    return sub - presence * generated.astype(mx.float32) - frequency * counts
