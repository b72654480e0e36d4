"""What the entry stage's scheduler and the pipeline exchange, as plain frozen values (no MLX, no I/O).

Contract:
- ``SequenceRecord`` is one sequence's share of a batch, ``RecordFlag`` what the batch does with it
  (``stage_worker.transport.wire`` packs both; every stage reads them).
- ``Chunk`` is a record with the token ids it feeds (the scheduler's output, the pipeline's input);
  ``SampledToken`` one token the last stage sampled (the pipeline's output), with its
  ``TokenLogprob`` when the request asked for logprobs.
- ``RowOptions`` is what the last stage keeps about a sequence from its start to its RELEASE: its
  ``SamplingParams`` and the context the logits processors need (the stop ids masked before
  ``min_tokens``, the prompt's length and, for a repetition penalty, its tokens).
  ``RowOptions.for_sequence`` gives None for a request the processors leave alone, so such a
  request sends nothing beyond its records.
- ``WireMismatchError`` is a message that contradicts what this stage holds: every room that reads the
  messages (the wire codecs, the KV store, the runtime) raises it, and the pipeline restarts on it.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from stagemesh_core.sampling import DEFAULTS, GREEDY, SamplingParams


class WireMismatchError(RuntimeError):
    """A neighbour sent something this stage cannot consume; the pipeline must restart."""


class RecordFlag(enum.IntFlag):
    NONE = 0
    NEW_SEQUENCE = 1  # start_pos must be 0; drop any KV held under this id
    SAMPLE = 2  # the last stage samples a token from this record's last row
    RELEASE = 4  # free this sequence's KV cache after the batch
    # Prefix caching (stage_worker.cache.prefix_cache decides on the entry stage; every stage obeys):
    # Keep the first start_pos positions as prefix entry ``prefix_entry``: with RELEASE as the sequence ends;
    # alone, a prompt checkpoint of a sequence that goes on (its state at start_pos, every position it holds).
    RETAIN = 8
    EVICT = 16  # drop prefix entry ``prefix_entry`` (zero tokens; seq_id unused)
    # Speculative decoding (stage_worker.speculation.rules): with SAMPLE, the record's tokens are the last sampled one
    # and proposals (their ids in the FORWARD body); the last stage keeps the longest prefix its argmax agrees
    # with plus one token, and replies with a TOKENS record of that many tokens.
    VERIFY = 32


@dataclass(frozen=True)
class SequenceRecord:
    """One sequence's share of a batch; for TOKENS, ``num_tokens`` is the sampled ids of the sequence (1, or
    the tokens a VERIFY record kept), ``start_pos`` the position the first of them occupies.

    A record starting before the position a stage's KV holds for its sequence drops the positions from
    ``start_pos`` on first (a verification's rejected proposals).

    ``sampling``: its sequence's sampling; the wire carries its temperature, top_p, top_k and seed with
    every record (what the sampler reads per row), the rest once in ``RowOptions``."""

    seq_id: int
    start_pos: int
    num_tokens: int
    flags: RecordFlag = RecordFlag.NONE
    sampling: SamplingParams = GREEDY
    # A prefix-cache entry (0: none). On a NEW_SEQUENCE record with start_pos K > 0: the sequence
    # starts from a copy of the entry's first K positions; on RETAIN / EVICT: the entry kept / dropped.
    prefix_entry: int = 0

    def has(self, flag: RecordFlag) -> bool:
        # int's own ``&``: IntFlag's builds a new enum member each call, and building a batch between GPU steps
        # calls this a few hundred times (docs/performance.md, "One GPU: through the whole mesh").
        return int.__and__(self.flags, flag) != 0


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's logprob and the most likely alternatives (most likely first)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class RowOptions:
    """A sequence's sampling and the context its logits processors need (see the module contract)."""

    sampling: SamplingParams = DEFAULTS
    stop_token_ids: tuple[int, ...] = ()  # masked while fewer than min_tokens were generated; the grammar's ends
    prompt_len: int = 0
    prompt_token_ids: tuple[int, ...] = ()  # only with a repetition penalty

    @classmethod
    def for_sequence(cls, sampling: SamplingParams, prompt: tuple[int, ...], stop_token_ids: Collection[int],
                     ignore_eos: bool) -> RowOptions | None:
        """A new sequence's options; None when the last stage has nothing to do for it beyond sampling."""
        stops = () if ignore_eos else tuple(sorted(set(stop_token_ids)))
        options = cls(
            sampling=sampling,
            stop_token_ids=stops if sampling.min_tokens or sampling.grammar else (),
            prompt_len=len(prompt),
            prompt_token_ids=prompt if sampling.repetition_penalty != 1.0 else (),
        )
        return None if options.is_default else options

    @property
    def penalized(self) -> bool:
        s = self.sampling
        return s.presence_penalty != 0.0 or s.frequency_penalty != 0.0 or s.repetition_penalty != 1.0

    @property
    def transforms_logits(self) -> bool:
        s = self.sampling
        return (self.penalized or bool(s.logit_bias) or bool(s.allowed_token_ids) or bool(s.grammar)
                or (s.min_tokens > 0 and bool(self.stop_token_ids)))

    @property
    def is_default(self) -> bool:
        return not self.transforms_logits and self.sampling.min_p == 0.0 and self.sampling.logprobs is None

    def to_json(self) -> dict[str, Any]:
        return {"sampling": self.sampling.to_json(), "stop_token_ids": list(self.stop_token_ids),
                "prompt_len": self.prompt_len, "prompt_token_ids": list(self.prompt_token_ids)}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> RowOptions:
        return cls(
            sampling=SamplingParams.from_json(raw.get("sampling", {})),
            stop_token_ids=tuple(int(t) for t in raw.get("stop_token_ids", ())),
            prompt_len=int(raw.get("prompt_len", 0)),
            prompt_token_ids=tuple(int(t) for t in raw.get("prompt_token_ids", ())),
        )


@dataclass(frozen=True)
class Chunk:
    """Tokens of one sequence entering the pipeline in one batch.

    ``carried``: a decode step whose one input token is the one sampled for the same sequence in
    the oldest batch in flight, not read back yet (``token_ids`` is empty).
    """

    record: SequenceRecord
    token_ids: tuple[int, ...]
    carried: bool = False
    options: RowOptions | None = None  # the sequence's options, on its first chunk only


@dataclass(frozen=True)
class SampledToken:
    seq_id: int
    position: int  # position the sampled token will occupy
    token_id: int
    logprob: TokenLogprob | None = None  # when the request asked for logprobs
