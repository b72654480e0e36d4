"""The sampling contract: what a request may ask of the sampler, with its ranges and defaults, in one place.

Contract:
- ``SamplingParams`` is the one shape of a request's sampling from the gateway to the last stage (frozen;
  OpenAI's and vLLM's defaults: ``SamplingParams()`` samples at temperature 1, ``GREEDY`` takes the argmax).
- ``RANGES`` holds every numeric field's range; ``MAX_LOGIT_BIAS`` and ``MAX_TOP_LOGPROBS`` the sizes.
  ``check(params, vocab_size=, max_tokens=, name=)`` enforces them and raises ``SamplingError``, a
  ``ValueError`` naming the field as the caller calls it (the gateway's JSON field, the stage's
  ``sampling.<field>``).
- The checks run once, in the gateway's request validation (``gateway.sampling_params``); the entry stage's
  gRPC boundary runs the same ``check`` for other callers (grpcurl, benchmarks, tests). Past it nothing
  checks again: the scheduler, the wire and the last stage trust what they receive.
- ``to_proto`` / ``from_proto`` are the one conversion to and from ``stagemesh.v1.SamplingParams``;
  ``to_json`` / ``from_json`` the one as plain JSON.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from stagemesh_core.v1 import stage_pb2

MAX_TOP_LOGPROBS = 20  # chat's top_logprobs and completions' logprobs (OpenAI: 20 and 5; vLLM: 20 for both)
MAX_LOGIT_BIAS = 1024  # tokens one request may bias
INT32_MAX = 2**31 - 1
UINT32_MAX = 2**32 - 1
SEED_MAX = 2**63 - 1  # the wire's seed is an int64 where -1 means "none": seeds are >= 0


@dataclass(frozen=True)
class SamplingParams:
    """How the last stage picks a request's tokens (applied in this order: logit_bias and
    allowed_token_ids, min_tokens, the penalties, the grammar; then temperature, top_k, top_p, min_p)."""

    temperature: float = 1.0  # 0: greedy (argmax)
    top_p: float = 1.0  # 1 disables
    top_k: int = 0  # 0 disables
    seed: int | None = None  # None: the stage draws one
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # times how often each token was generated
    repetition_penalty: float = 1.0  # 1 disables: divides (multiplies if < 0) logits of prompt and output tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), sorted by id
    allowed_token_ids: tuple[int, ...] = ()  # non-empty: only these can be sampled
    min_p: float = 0.0  # 0 disables
    min_tokens: int = 0  # the stop tokens cannot be sampled before this many tokens
    logprobs: int | None = None  # None: no logprobs; else the chosen token's and this many top ones
    grammar: str = ""  # non-empty: an llguidance grammar the output must follow

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_json(self) -> dict[str, Any]:
        return {f.name: _jsonable(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> SamplingParams:
        """The inverse of ``to_json``; a missing key takes its default."""
        d = DEFAULTS
        seed, logprobs = raw.get("seed"), raw.get("logprobs")
        return cls(
            temperature=float(raw.get("temperature", d.temperature)), top_p=float(raw.get("top_p", d.top_p)),
            top_k=int(raw.get("top_k", d.top_k)), seed=None if seed is None else int(seed),
            presence_penalty=float(raw.get("presence_penalty", d.presence_penalty)),
            frequency_penalty=float(raw.get("frequency_penalty", d.frequency_penalty)),
            repetition_penalty=float(raw.get("repetition_penalty", d.repetition_penalty)),
            logit_bias=tuple((int(t), float(b)) for t, b in raw.get("logit_bias", ())),
            allowed_token_ids=tuple(int(t) for t in raw.get("allowed_token_ids", ())),
            min_p=float(raw.get("min_p", d.min_p)), min_tokens=int(raw.get("min_tokens", d.min_tokens)),
            logprobs=None if logprobs is None else int(logprobs), grammar=str(raw.get("grammar", d.grammar)),
        )


DEFAULTS = SamplingParams()
GREEDY = replace(DEFAULTS, temperature=0.0)


@dataclass(frozen=True)
class Range:
    """The values a numeric field may take."""

    low: float
    high: float
    low_open: bool = False  # low itself is excluded
    integer: bool = False  # an integer field: "between low and high"
    wording: str = ""  # how a message says the range, where brackets would not read well

    def __contains__(self, value: float) -> bool:
        return math.isfinite(value) and (self.low < value if self.low_open else self.low <= value) \
            and value <= self.high

    def describe(self) -> str:
        if self.wording:
            return self.wording
        if self.integer:
            return f"between {self.low} and {self.high}"
        return f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}]"


RANGES: dict[str, Range] = {
    "temperature": Range(0, 2),
    "top_p": Range(0, 1, low_open=True),
    "top_k": Range(0, INT32_MAX, integer=True, wording=f"0 (disabled) or between 1 and {INT32_MAX}"),
    "seed": Range(0, SEED_MAX, integer=True),
    "presence_penalty": Range(-2, 2),
    "frequency_penalty": Range(-2, 2),
    "repetition_penalty": Range(0, 2, low_open=True),
    "min_p": Range(0, 1),
    "min_tokens": Range(0, UINT32_MAX, integer=True),
    "logprobs": Range(0, MAX_TOP_LOGPROBS, integer=True),
    "logit_bias": Range(-100, 100),  # each bias
}


class SamplingError(ValueError):
    """A sampling field out of its range; ``name`` is the field as the caller calls it."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name


def _same(field: str) -> str:
    return field


def check(params: SamplingParams, *, vocab_size: int | None = None, max_tokens: int | None = None,
          name: Callable[[str], str] = _same) -> None:
    """Raise ``SamplingError`` for the first field of ``params`` outside its range.

    ``vocab_size``: token ids must be below it (None: only >= 0). ``max_tokens``: the request's token
    budget, which ``min_tokens`` may not exceed (None: unknown yet). ``name(field)`` is how the message
    calls a field (and ``max_tokens``)."""
    for field in ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty",
                  "repetition_penalty", "min_p", "min_tokens", "logprobs"):
        value = getattr(params, field)
        if value is None:
            continue
        if field == "min_tokens" and max_tokens is not None:
            if not 0 <= value <= max_tokens:
                raise SamplingError(name(field), f"{name(field)} must be between 0 and {name('max_tokens')} "
                                                 f"({max_tokens}), got {value}.")
        elif value not in RANGES[field]:
            raise SamplingError(name(field), f"{name(field)} must be {RANGES[field].describe()}, got {value}.")
    if len(params.logit_bias) > MAX_LOGIT_BIAS:
        raise SamplingError(name("logit_bias"), f"{name('logit_bias')} may hold at most {MAX_LOGIT_BIAS} tokens, "
                                                f"got {len(params.logit_bias)}.")
    for token, bias in params.logit_bias:
        check_token_ids(name("logit_bias"), (token,), vocab_size)
        if bias not in RANGES["logit_bias"]:
            raise SamplingError(name("logit_bias"), f"{name('logit_bias')} must be "
                                                    f"{RANGES['logit_bias'].describe()}, got {bias}.")
    check_token_ids(name("allowed_token_ids"), params.allowed_token_ids, vocab_size)


def check_token_ids(name: str, ids: Iterable[int], vocab_size: int | None) -> None:
    """Raise ``SamplingError`` (naming ``name``) for an id outside the vocabulary (or below 0)."""
    for token in ids:
        if token < 0 or (vocab_size is not None and token >= vocab_size) or token > INT32_MAX:
            ids_are = "0 or more" if vocab_size is None else f"0..{vocab_size - 1}"
            raise SamplingError(name, f"{name}: token id {token} is out of the vocabulary ({ids_are}).")


def to_proto(params: SamplingParams) -> stage_pb2.SamplingParams:
    """``params`` as ``stagemesh.v1.SamplingParams``. proto3 cannot tell an unset float from 0: temperature 0
    is greedy, and top_p or repetition_penalty 0 mean their default (``from_proto``)."""
    message = stage_pb2.SamplingParams(
        temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
        presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty, logit_bias=dict(params.logit_bias), min_p=params.min_p,
        min_tokens=params.min_tokens, allowed_token_ids=params.allowed_token_ids, grammar=params.grammar)
    if params.seed is not None:
        message.seed = params.seed
    if params.logprobs is not None:
        message.logprobs = params.logprobs
    return message


def from_proto(message: stage_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=message.temperature,  # proto3's zero: greedy
        top_p=message.top_p or DEFAULTS.top_p,  # proto3's zero: unset (0 is out of range)
        top_k=message.top_k,
        seed=message.seed if message.HasField("seed") else None,
        presence_penalty=message.presence_penalty, frequency_penalty=message.frequency_penalty,
        repetition_penalty=message.repetition_penalty or DEFAULTS.repetition_penalty,  # zero: unset
        logit_bias=tuple(sorted(message.logit_bias.items())),
        allowed_token_ids=tuple(message.allowed_token_ids),
        min_p=message.min_p, min_tokens=message.min_tokens,
        logprobs=message.logprobs if message.HasField("logprobs") else None,
        grammar=message.grammar,
    )


def _jsonable(value: Any) -> Any:
    return [list(v) if isinstance(v, tuple) else v for v in value] if isinstance(value, tuple) else value
