"""The ONE place that maps OpenAI request fields to what a stage is asked to do.

Contract:
- ``settings_from_request(req, defaults, vocab_size)`` validates every
  generation-related field of a completion or chat request and returns frozen
  ``SamplingSettings``, or raises a 400 ``APIError`` whose ``param`` names the
  field. Unset fields take the model's generation-config ``defaults`` (vLLM's
  ``--generation-config``), else OpenAI's defaults. Fields the stages cannot
  honour (beam search, prompt logprobs, ...) are refused when set to anything
  but their default, never silently ignored. Token ids (``logit_bias`` keys,
  ``stop_token_ids``, ``allowed_token_ids``) must be below ``vocab_size``.
- ``SamplingSettings.max_tokens_for(prompt_len, max_model_len)`` resolves the
  token budget: the room left in the context by default; a prompt that leaves
  no room, or an explicit budget that does not fit, is a 400 naming the
  numbers (we never clamp silently: the client would get less than it asked
  for without knowing why).
- ``SamplingSettings.stage_sampling(choice)`` is the stage's
  ``SamplingParams`` for choice ``choice`` (seed + choice when seeded), and
  ``stop_token_ids(eos)`` the ids the stage stops at (EOS unless ``ignore_eos``,
  plus the request's ``stop_token_ids``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from stagemesh.core.v1 import stage_pb2

from .errors import APIError, bad_request, unsupported
from .openai_defaults import GenerationDefaults
from .schemas import DEFAULT_ONLY, ChatCompletionRequest, CompletionRequest
from .structured_output import grammar_for

MAX_N = 16
MAX_STOP_STRINGS = 4
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 1024
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs and completions' logprobs (OpenAI: 20 and 5; vLLM: 20 for both)
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_INT32_MAX = 2**31 - 1
_STAGE_SEED_MOD = 2**63  # the wire's seed is an int64 where -1 means "none": keep stage seeds >= 0


@dataclass(frozen=True)
class SamplingSettings:
    n: int
    temperature: float
    top_p: float
    top_k: int  # stage convention: 0 disables
    seed: int | None
    stop: tuple[str, ...]
    ignore_eos: bool
    max_tokens: int | None  # as requested; None: the room left in the context
    max_tokens_param: str  # the field the client used, for error messages
    stream: bool
    include_usage: bool
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] = ()
    min_p: float = 0.0
    min_tokens: int = 0
    user_stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None  # None: no logprobs; else how many top alternatives
    echo: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    add_special_tokens: bool | None = None  # None: the endpoint's default
    grammar: str | None = None  # llguidance grammar of a structured-output request

    def max_tokens_for(self, prompt_len: int, max_model_len: int, prompt_param: str) -> int:
        if prompt_len >= max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
                f"contains {prompt_len} input tokens, which leaves no room for a completion. Please shorten it.",
                param=prompt_param, code="context_length_exceeded")
        if self.max_tokens is None:
            return max_model_len - prompt_len
        if prompt_len + self.max_tokens > max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{prompt_len + self.max_tokens} tokens ({prompt_len} in the prompt, {self.max_tokens} in the "
                f"completion). Please reduce the length of the prompt or {self.max_tokens_param} "
                f"(at most {max_model_len - prompt_len} here).",
                param=self.max_tokens_param, code="context_length_exceeded")
        return self.max_tokens

    def stage_sampling(self, choice: int) -> stage_pb2.SamplingParams:
        params = stage_pb2.SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logit_bias=dict(self.logit_bias),
            min_p=self.min_p, min_tokens=self.min_tokens, allowed_token_ids=self.allowed_token_ids)
        if self.seed is not None:
            # Choices must differ yet stay reproducible: seed + i, folded into the stage's range.
            params.seed = (self.seed + choice) % _STAGE_SEED_MOD
        if self.logprobs is not None:
            params.logprobs = self.logprobs
        if self.grammar:
            params.grammar = self.grammar
        return params

    def stop_token_ids(self, eos_token_ids: frozenset[int]) -> frozenset[int]:
        """What the stage stops at: EOS (unless ignore_eos, as vLLM) and the request's stop_token_ids."""
        return frozenset(self.user_stop_token_ids) | (frozenset() if self.ignore_eos else eos_token_ids)


def _first(*values):
    return next((v for v in values if v is not None), None)


def _in_range(value: float, low: float, high: float, name: str, *, open_low: bool = False) -> float:
    ok = math.isfinite(value) and (low < value if open_low else low <= value) and value <= high
    if not ok:
        raise bad_request(f"{name} must be in {'(' if open_low else '['}{low:g}, {high:g}], got {value}.", name)
    return float(value)


def _token_ids(ids: Sequence[int], name: str, vocab_size: int | None, limit: int) -> tuple[int, ...]:
    if len(ids) > limit:
        raise bad_request(f"{name} may hold at most {limit} token ids, got {len(ids)}.", name)
    for t in ids:
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            raise bad_request(f"{name}: token id {t} is out of the vocabulary (0..{(vocab_size or 1) - 1}).", name)
    return tuple(dict.fromkeys(ids))


def _logit_bias(bias: dict[str, float] | None, vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    if not bias:
        return ()
    if len(bias) > MAX_LOGIT_BIAS:
        raise bad_request(f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}.", "logit_bias")
    out = []
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids (integers as strings), got {key!r}.",
                              "logit_bias") from None
        _token_ids([token], "logit_bias", vocab_size, 1)
        out.append((token, _in_range(value, -100.0, 100.0, "logit_bias")))
    return tuple(sorted(out))


def _logprobs(req: CompletionRequest | ChatCompletionRequest) -> int | None:
    if isinstance(req, CompletionRequest):
        if req.logprobs is None:
            return None
        if not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
            raise bad_request(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {req.logprobs}.", "logprobs")
        return req.logprobs
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true.", "top_logprobs")
        if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise bad_request(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {req.top_logprobs}.",
                              "top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


def settings_from_request(req: CompletionRequest | ChatCompletionRequest,
                          defaults: GenerationDefaults | None = None,
                          vocab_size: int | None = None) -> SamplingSettings:
    d = defaults or GenerationDefaults()
    _refuse_unsupported(req)
    n = 1 if req.n is None else req.n
    if not 1 <= n <= MAX_N:
        raise bad_request(f"n must be between 1 and {MAX_N}, got {n}.", "n")

    temperature = _first(req.temperature, d.temperature, 1.0)
    if not math.isfinite(temperature) or not 0.0 <= temperature <= 2.0:
        raise bad_request(f"temperature must be in [0, 2], got {temperature}.", "temperature")
    top_p = _first(req.top_p, d.top_p, 1.0)
    if not math.isfinite(top_p) or not 0.0 < top_p <= 1.0:
        raise bad_request(f"top_p must be in (0, 1], got {top_p}.", "top_p")
    raw_top_k = _first(req.top_k, d.top_k)
    top_k = 0 if raw_top_k is None or raw_top_k in (-1, 0) else raw_top_k
    if not 0 <= top_k <= _INT32_MAX:
        raise bad_request(f"top_k must be -1 or 0 (disabled) or at least 1, got {req.top_k}.", "top_k")
    if req.seed is not None and not _INT64_MIN <= req.seed <= _INT64_MAX:
        raise bad_request(f"seed must fit in a signed 64-bit integer, got {req.seed}.", "seed")
    presence = _in_range(_first(req.presence_penalty, 0.0), -2.0, 2.0, "presence_penalty")
    frequency = _in_range(_first(req.frequency_penalty, 0.0), -2.0, 2.0, "frequency_penalty")
    repetition = _in_range(_first(req.repetition_penalty, d.repetition_penalty, 1.0), 0.0, 2.0,
                           "repetition_penalty", open_low=True)
    min_p = _in_range(_first(req.min_p, d.min_p, 0.0), 0.0, 1.0, "min_p")

    max_tokens, param = req.max_tokens, "max_tokens"
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        max_tokens, param = req.max_completion_tokens, "max_completion_tokens"  # the newer name wins
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"{param} must be at least 1, got {max_tokens}.", param)
    if max_tokens is None:
        max_tokens = d.max_tokens
    min_tokens = _first(req.min_tokens, 0)
    if min_tokens < 0 or (max_tokens is not None and min_tokens > max_tokens):
        raise bad_request(f"min_tokens must be between 0 and {param} ({max_tokens}), got {min_tokens}.",
                          "min_tokens")

    stream = bool(req.stream)
    if req.stream_options is not None and not stream:
        raise bad_request("stream_options is only allowed when stream is true.", "stream_options")
    include_usage = bool(stream and req.stream_options and req.stream_options.include_usage)

    grammar = grammar_for(req)
    if grammar is not None and req.ignore_eos:
        raise bad_request("ignore_eos cannot be combined with structured output: the output ends where its "
                          "format does.", "ignore_eos")
    if grammar is not None and min_tokens:
        raise bad_request("min_tokens cannot be combined with structured output: the output ends where its "
                          "format does.", "min_tokens")
    echo = bool(isinstance(req, CompletionRequest) and req.echo)
    logprobs = _logprobs(req)
    if echo and logprobs is not None:
        raise unsupported("echo", "echo with logprobs would need the prompt's logprobs, which are not computed.")
    return SamplingSettings(
        n=n, temperature=float(temperature), top_p=float(top_p), top_k=top_k, seed=req.seed,
        stop=_stop_strings(req.stop), ignore_eos=bool(req.ignore_eos), max_tokens=max_tokens,
        max_tokens_param=param, stream=stream, include_usage=include_usage,
        presence_penalty=presence, frequency_penalty=frequency, repetition_penalty=repetition,
        logit_bias=_logit_bias(req.logit_bias, vocab_size),
        allowed_token_ids=_token_ids(req.allowed_token_ids or [], "allowed_token_ids", vocab_size, _INT32_MAX),
        min_p=min_p, min_tokens=min_tokens,
        user_stop_token_ids=_token_ids(req.stop_token_ids or [], "stop_token_ids", vocab_size, MAX_STOP_TOKEN_IDS),
        logprobs=logprobs, echo=echo, skip_special_tokens=_first(req.skip_special_tokens, True),
        include_stop_str_in_output=bool(req.include_stop_str_in_output), add_special_tokens=req.add_special_tokens,
        grammar=grammar,
    )


def _stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(stops)}.", "stop")
    if any(s == "" for s in stops):
        raise bad_request("stop must not contain an empty string.", "stop")
    return tuple(dict.fromkeys(stops))


def _refuse_unsupported(req: CompletionRequest | ChatCompletionRequest) -> None:
    """400 for every field set to something the stages cannot do."""
    for field, (default, why) in DEFAULT_ONLY.items():
        value = getattr(req, field)
        if value is not None and value != default:
            raise unsupported(field, why)
    if req.bad_words:
        raise unsupported("bad_words", "Use logit_bias with -100 for the tokens to avoid.")
    if isinstance(req, CompletionRequest):
        if req.suffix:
            raise unsupported("suffix")
        if req.best_of not in (None, 1):
            raise unsupported("best_of", "Use n for several completions.")
        return
    if req.functions:
        raise unsupported("functions", "Use tools (function calling's current form).")
    if req.function_call not in (None, "none", "auto"):
        raise unsupported("function_call", "Use tool_choice (function calling's current form).")
    if req.store:
        raise unsupported("store", "Completions are not stored.")
    if req.modalities not in (None, ["text"]):
        raise unsupported("modalities", "Only text output is produced.")
    for field in ("reasoning_effort", "audio", "prediction", "web_search_options"):
        if getattr(req, field) is not None:
            raise unsupported(field)
