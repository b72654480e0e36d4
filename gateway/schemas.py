"""Pydantic request models of the OpenAI endpoints the gateway serves.

Contract: these models only *type* the JSON (so FastAPI can turn a malformed
body into a 400 and /openapi.json documents the API). Unknown top-level fields
are rejected (OpenAI does the same), never silently ignored. Whether a value
is in range, supported, or fits the context is decided in one place,
``gateway.sampling_params`` (and the prompt modules), so every message about a
field comes from there. Fields we accept but cannot honour are declared here
with their OpenAI default so that sending the default stays legal.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # we never obfuscate; accepted for SDK compatibility


class _CommonRequest(_Strict):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM extension
    n: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # metadata only
    ignore_eos: bool | None = None  # vLLM extension, passed to the stage
    # Accepted only at their defaults (checked in sampling_params).
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None


class CompletionRequest(_CommonRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(BaseModel):
    # Clients often send back the assistant message object they received
    # (with refusal/annotations/audio nulls), so unknown keys are tolerated here.
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_CommonRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
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
