"""The ONE place that maps a request's generation fields to what a stage is asked to do.

Contract:
- ``settings_from_request(req, defaults, vocab_size, strict_schemas)`` validates every generation-related field of a request
  (``GenerationFields``: a chat request, a completion) and returns frozen ``SamplingSettings``, or raises a
  400 ``APIError`` whose ``param`` names the field. Unset fields take the model's generation-config
  ``defaults``, else the core's; fields the stages cannot honour are refused when set to anything but their
  default, never silently ignored.
- ``SamplingSettings.sampling`` is the request's core ``SamplingParams``; the other fields are the request's
  own (choices, stop strings, streaming, output).
- ``SamplingSettings.max_tokens_for(prompt_len, max_model_len, prompt_param, fill_context)`` resolves the token budget,
  never clamping it silently; ``stage_sampling(choice)`` is the stage's ``SamplingParams`` message for one
  choice and ``stop_token_ids(eos)`` the ids the stage stops at.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from gateway.http.errors import APIError, bad_request, unsupported
from stagemesh_core import sampling
from stagemesh_core.sampling import SamplingError, SamplingParams
from stagemesh_core.v1 import stage_pb2

from .defaults import GenerationDefaults
from .grammar import grammar_for
from .request import MAX_N, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, GenerationFields

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_STAGE_SEED_MOD = sampling.SEED_MAX + 1  # the core's seeds are >= 0: request seeds are folded into its range


@dataclass(frozen=True)
class SamplingSettings:
    n: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    ignore_eos: bool
    max_tokens: int | None  # as requested; None: the room left in the context
    max_tokens_param: str  # the field the client used, for error messages
    stream: bool
    include_usage: bool
    user_stop_token_ids: tuple[int, ...] = ()
    echo: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    add_special_tokens: bool | None = None  # None: the endpoint's default

    def max_tokens_for(self, prompt_len: int, max_model_len: int, prompt_param: str,
                       fill_context: bool = False) -> int:
        """The room left in the context by default; a prompt that leaves no room is a 400 naming the numbers,
        and so is an explicit budget that does not fit (clamping silently would give the client less than it
        asked for without saying why), unless ``fill_context``: an API that promises to generate to the end of
        the context and say so (Anthropic's ``model_context_window_exceeded``) gets the room left."""
        if prompt_len >= max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
                f"contains {prompt_len} input tokens, which leaves no room for a completion. Please shorten it.",
                param=prompt_param, code="context_length_exceeded")
        if self.max_tokens is None:
            return max_model_len - prompt_len
        if prompt_len + self.max_tokens > max_model_len and fill_context:
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

    def with_grammar(self, grammar: str) -> SamplingSettings:
        return replace(self, sampling=replace(self.sampling, grammar=grammar))

    def stage_sampling(self, choice: int) -> stage_pb2.SamplingParams:
        """The stage's message for choice ``choice`` (seed + choice when seeded)."""
        params = self.sampling
        if params.seed is not None:
            # Choices must differ yet stay reproducible: seed + i, folded into the stage's range.
            params = replace(params, seed=(params.seed + choice) % _STAGE_SEED_MOD)
        return sampling.to_proto(params)

    def stop_token_ids(self, eos_token_ids: frozenset[int]) -> frozenset[int]:
        """What the stage stops at: EOS (unless ignore_eos, as vLLM) and the request's stop_token_ids."""
        return frozenset(self.user_stop_token_ids) | (frozenset() if self.ignore_eos else eos_token_ids)


def _first(*values):
    return next((v for v in values if v is not None), None)


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """The request's bias by token id (the core checks the ids and the values)."""
    out = []
    for key, value in (bias or {}).items():
        try:
            out.append((int(key), float(value)))
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids (integers as strings), got {key!r}.",
                              "logit_bias") from None
    return tuple(sorted(out))


def settings_from_request(req: GenerationFields,
                          defaults: GenerationDefaults | None = None,
                          vocab_size: int | None = None, strict_schemas: bool = True) -> SamplingSettings:
    """The sampling fields' ranges are the core's (``stagemesh_core.sampling``: its ``check`` runs here, with
    each field named as the request names it); the request's own limits (``n``, ``stop``, ``stop_token_ids``,
    ...) are the schema's (``gateway.chat.request``). Unset fields take ``defaults`` (vLLM's
    ``--generation-config``), else the core's defaults (OpenAI's). Fields the stages cannot honour (beam
    search, prompt logprobs, ...) are refused unless at their default. Token ids (``logit_bias`` keys,
    ``stop_token_ids``, ``allowed_token_ids``) must be below ``vocab_size``."""
    d = defaults or GenerationDefaults()
    core = sampling.DEFAULTS
    req.refuse_unsupported()
    n = 1 if req.n is None else req.n
    if not 1 <= n <= MAX_N:
        raise bad_request(f"n must be between 1 and {MAX_N}, got {n}.", "n")
    if req.seed is not None and not _INT64_MIN <= req.seed <= _INT64_MAX:
        raise bad_request(f"seed must fit in a signed 64-bit integer, got {req.seed}.", "seed")

    max_tokens, param = req.token_budget()
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"{param} must be at least 1, got {max_tokens}.", param)
    if max_tokens is None:
        max_tokens = d.max_tokens

    top_k = _first(req.top_k, d.top_k, core.top_k)
    params = SamplingParams(
        temperature=float(_first(req.temperature, d.temperature, core.temperature)),
        top_p=float(_first(req.top_p, d.top_p, core.top_p)),
        top_k=0 if top_k == -1 else top_k,  # OpenAI-style -1 disables, as the core's 0 does
        seed=None if req.seed is None else req.seed % _STAGE_SEED_MOD,
        presence_penalty=float(_first(req.presence_penalty, core.presence_penalty)),
        frequency_penalty=float(_first(req.frequency_penalty, core.frequency_penalty)),
        repetition_penalty=float(_first(req.repetition_penalty, d.repetition_penalty, core.repetition_penalty)),
        logit_bias=_logit_bias(req.logit_bias),
        allowed_token_ids=tuple(dict.fromkeys(req.allowed_token_ids or [])),
        min_p=float(_first(req.min_p, d.min_p, core.min_p)),
        min_tokens=_first(req.min_tokens, core.min_tokens),
        logprobs=req.requested_logprobs(),
    )
    names = {"max_tokens": param, "logprobs": req.LOGPROBS_FIELD}
    stop_token_ids = req.stop_token_ids or []
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise bad_request(f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} token ids, got "
                          f"{len(stop_token_ids)}.", "stop_token_ids")
    try:
        sampling.check(params, vocab_size=vocab_size, max_tokens=max_tokens, name=lambda f: names.get(f, f))
        sampling.check_token_ids("stop_token_ids", stop_token_ids, vocab_size)
    except SamplingError as exc:
        raise bad_request(str(exc), exc.name) from None

    stream = bool(req.stream)
    if req.stream_options is not None and not stream:
        raise bad_request("stream_options is only allowed when stream is true.", "stream_options")
    include_usage = bool(stream and req.stream_options and req.stream_options.include_usage)

    grammar = grammar_for(req, strict_schemas)
    if grammar is not None and req.ignore_eos:
        raise bad_request("ignore_eos cannot be combined with structured output: the output ends where its "
                          "format does.", "ignore_eos")
    if grammar is not None and params.min_tokens:
        raise bad_request("min_tokens cannot be combined with structured output: the output ends where its "
                          "format does.", "min_tokens")
    echo = req.echoes()
    if echo and params.logprobs is not None:
        raise unsupported("echo", "echo with logprobs would need the prompt's logprobs, which are not computed.")
    return SamplingSettings(
        n=n, sampling=replace(params, grammar=grammar or ""), stop=_stop_strings(req.stop),
        ignore_eos=bool(req.ignore_eos), max_tokens=max_tokens, max_tokens_param=param, stream=stream,
        include_usage=include_usage, user_stop_token_ids=tuple(dict.fromkeys(stop_token_ids)),
        echo=echo, skip_special_tokens=_first(req.skip_special_tokens, True),
        include_stop_str_in_output=bool(req.include_stop_str_in_output), add_special_tokens=req.add_special_tokens,
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
