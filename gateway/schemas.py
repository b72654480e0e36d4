"""Pydantic request models of the OpenAI endpoints the gateway serves.

Contract: these models only *type* the JSON (so FastAPI can turn a malformed
body into a 400 and /openapi.json documents the API). Unknown top-level fields
are rejected (OpenAI does the same), never silently ignored. Whether a value
is in range, supported, or fits the context is decided in one place,
``gateway.sampling_params`` (and the prompt modules), so every message about a
field comes from there. Fields we accept but cannot honour are declared here
with their OpenAI default so that sending the default stays legal.

The documented ranges (``_doc``) are the same ones ``gateway.sampling_params``
enforces, only *described* here (``json_schema_extra``), so /openapi.json is as
tight as the validation while the 400s keep their own wording;
``gateway.openapi`` adds the vocabulary and context bounds of the served model.
"""

from __future__ import annotations

from typing import Any, cast

from pydantic import BaseModel, ConfigDict, Field


def _doc(**schema: Any) -> Any:
    """An optional field whose documented JSON Schema gains ``schema`` (the run-time checks are elsewhere)."""
    return Field(default=None, json_schema_extra=schema)


_TOKEN_IDS = {"x-token-ids": True}
_ROLES = ["system", "developer", "user", "assistant", "tool"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # we never obfuscate; accepted for SDK compatibility


class _CommonRequest(_Strict):
    model: str | None = None
    max_tokens: int | None = _doc(minimum=1, **{"x-max-tokens": True})
    temperature: float | None = _doc(minimum=0, maximum=2)
    top_p: float | None = _doc(exclusiveMinimum=0, maximum=1)
    n: int | None = _doc(minimum=1, maximum=16)
    seed: int | None = _doc(minimum=-(2**63), maximum=2**63 - 1)
    stop: str | list[str] | None = _doc(anyOf=[{"type": "string", "minLength": 1},
                                               {"type": "array", "maxItems": 4,
                                                "items": {"type": "string", "minLength": 1}},
                                               {"type": "null"}])
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # metadata only
    presence_penalty: float | None = _doc(minimum=-2, maximum=2)
    frequency_penalty: float | None = _doc(minimum=-2, maximum=2)
    logit_bias: dict[str, float] | None = _doc(maxProperties=1024, propertyNames={"pattern": "^[0-9]{1,4}$"},
                                               additionalProperties={"type": "number", "minimum": -100,
                                                                     "maximum": 100})
    # vLLM's extra sampling parameters (docs/api.md lists each with its range and default).
    top_k: int | None = _doc(minimum=-1, maximum=2**31 - 1)
    min_p: float | None = _doc(minimum=0, maximum=1)
    repetition_penalty: float | None = _doc(exclusiveMinimum=0, maximum=2)
    min_tokens: int | None = _doc(minimum=0)
    stop_token_ids: list[int] | None = _doc(maxItems=64, **_TOKEN_IDS)
    ignore_eos: bool | None = None
    allowed_token_ids: list[int] | None = _doc(**_TOKEN_IDS)
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    add_special_tokens: bool | None = None
    request_id: str | None = None  # metadata only
    # vLLM's fields accepted only at their defaults (checked in sampling_params).
    spaces_between_special_tokens: bool | None = None
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    priority: int | None = None
    bad_words: list[str] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's newer form: {"json" | "regex" | "choice" | "grammar"}
    return_tokens_as_token_ids: bool | None = None


class CompletionRequest(_CommonRequest):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(json_schema_extra={"anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "minItems": 1, "items": {"type": "integer", "x-token-id": True}},
        {"type": "array", "minItems": 1, "maxItems": 32, "items": {"type": "string", "minLength": 1}},
        {"type": "array", "minItems": 1, "maxItems": 32,
         "items": {"type": "array", "minItems": 1, "items": {"type": "integer", "x-token-id": True}}}]})
    logprobs: int | None = _doc(minimum=0, maximum=20)
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(BaseModel):
    # Clients often send back the assistant message object they received
    # (with refusal/annotations/audio nulls), so unknown keys are tolerated here.
    model_config = ConfigDict(extra="ignore")

    role: str = Field(json_schema_extra={"enum": cast(Any, _ROLES)})
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_CommonRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    # vLLM's chat extensions: the template, its variables, how the prompt ends.
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = _doc(minimum=0, maximum=20)
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None  # metadata only
    store: bool | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
