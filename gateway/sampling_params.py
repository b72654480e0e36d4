"""The ONE place that maps OpenAI request fields to what a stage is asked to do.

Contract:
- ``settings_from_request(req)`` validates every generation-related field of a
  completion or chat request and returns frozen ``SamplingSettings``, or raises
  a 400 ``APIError`` whose ``param`` names the field. Fields the stages cannot
  honour (penalties, logit_bias, logprobs, tools, ...) are refused when set to
  anything but their default, never silently ignored.
- ``SamplingSettings.max_tokens_for(prompt_len, max_model_len)`` resolves the
  token budget: the room left in the context by default; a prompt that leaves
  no room, or an explicit budget that does not fit, is a 400 naming the
  numbers (we never clamp silently: the client would get less than it asked
  for without knowing why).
- ``SamplingSettings.stage_sampling(choice)`` is the stage's
  ``SamplingParams`` for choice ``choice`` (seed + choice when seeded).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from stagemesh.core.v1 import stage_pb2

from .errors import APIError, bad_request, unsupported
from .schemas import ChatCompletionRequest, CompletionRequest

MAX_N = 16
MAX_STOP_STRINGS = 4
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
        params = stage_pb2.SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)
        if self.seed is not None:
            # Choices must differ yet stay reproducible: seed + i, folded into the stage's range.
            params.seed = (self.seed + choice) % _STAGE_SEED_MOD
        return params


def settings_from_request(req: CompletionRequest | ChatCompletionRequest) -> SamplingSettings:
    _refuse_unsupported(req)
    n = 1 if req.n is None else req.n
    if not 1 <= n <= MAX_N:
        raise bad_request(f"n must be between 1 and {MAX_N}, got {n}.", "n")

    temperature = 1.0 if req.temperature is None else req.temperature
    if not math.isfinite(temperature) or not 0.0 <= temperature <= 2.0:
        raise bad_request(f"temperature must be in [0, 2], got {temperature}.", "temperature")
    top_p = 1.0 if req.top_p is None else req.top_p
    if not math.isfinite(top_p) or not 0.0 < top_p <= 1.0:
        raise bad_request(f"top_p must be in (0, 1], got {top_p}.", "top_p")
    top_k = 0 if req.top_k is None or req.top_k in (-1, 0) else req.top_k
    if not 0 <= top_k <= _INT32_MAX:
        raise bad_request(f"top_k must be -1 or 0 (disabled) or at least 1, got {req.top_k}.", "top_k")
    if req.seed is not None and not _INT64_MIN <= req.seed <= _INT64_MAX:
        raise bad_request(f"seed must fit in a signed 64-bit integer, got {req.seed}.", "seed")

    max_tokens, param = req.max_tokens, "max_tokens"
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        max_tokens, param = req.max_completion_tokens, "max_completion_tokens"  # the newer name wins
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"{param} must be at least 1, got {max_tokens}.", param)

    stream = bool(req.stream)
    if req.stream_options is not None and not stream:
        raise bad_request("stream_options is only allowed when stream is true.", "stream_options")
    include_usage = bool(stream and req.stream_options and req.stream_options.include_usage)

    return SamplingSettings(
        n=n, temperature=float(temperature), top_p=float(top_p), top_k=top_k, seed=req.seed,
        stop=_stop_strings(req.stop), ignore_eos=bool(req.ignore_eos), max_tokens=max_tokens,
        max_tokens_param=param, stream=stream, include_usage=include_usage,
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
    if req.logprobs not in (None, False):
        raise unsupported("logprobs", "Logprobs are not supported: the stages return token ids only.")
    for field in ("presence_penalty", "frequency_penalty"):
        if getattr(req, field) not in (None, 0, 0.0):
            raise unsupported(field, "Only the default 0 is accepted.")
    if req.logit_bias:
        raise unsupported("logit_bias")
    if isinstance(req, CompletionRequest):
        if req.echo:
            raise unsupported("echo")
        if req.suffix:
            raise unsupported("suffix")
        if req.best_of not in (None, 1):
            raise unsupported("best_of", "Use n for several completions.")
        return
    if req.top_logprobs not in (None, 0):
        raise unsupported("top_logprobs", "Logprobs are not supported: the stages return token ids only.")
    if req.response_format is not None and req.response_format.get("type", "text") != "text":
        raise unsupported("response_format", "Only {\"type\": \"text\"} is accepted.")
    if req.tools:
        raise unsupported("tools", "Tool calling is not implemented.")
    if req.tool_choice not in (None, "none", "auto"):
        raise unsupported("tool_choice", "Tool calling is not implemented.")
    if req.functions:
        raise unsupported("functions", "Function calling is not implemented.")
    if req.function_call not in (None, "none", "auto"):
        raise unsupported("function_call", "Function calling is not implemented.")
    if req.store:
        raise unsupported("store", "Completions are not stored.")
    if req.modalities not in (None, ["text"]):
        raise unsupported("modalities", "Only text output is produced.")
    for field in ("reasoning_effort", "audio", "prediction", "web_search_options"):
        if getattr(req, field) is not None:
            raise unsupported(field)
