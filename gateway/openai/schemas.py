"""The OpenAI endpoints' request bodies: the core's request, with what only OpenAI's API has.

Contract: ``CompletionRequest`` (``POST /v1/completions``) is the core's ``GenerationFields`` with a prompt,
integer ``logprobs``, ``echo`` and the fields it accepts at their default only (``suffix``, ``best_of``);
``ChatCompletionRequest`` (``POST /v1/chat/completions``) is the core's ``ChatRequest`` with OpenAI's fields
the stages cannot serve, accepted at their default only (``functions``, ``store``, ``modalities``, ...) and
refused otherwise, naming the field. Unknown top-level fields are a 400 (OpenAI does the same). The rules
between fields are documented in JSON Schema (``request_rules``); the checks are the core's.
"""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field

from gateway.chat.request import (
    CONTINUE_FINAL_RULE,
    STREAM_OPTIONS_NEED_STREAM,
    TOOLS_NEEDED_RULE,
    ChatRequest,
    GenerationFields,
    in_range,
    one_constraint_at_most,
)
from gateway.http.errors import unsupported
from gateway.http.schema import NULL, doc, either, nullable, properties, request_rules, set_to


class CompletionRequest(GenerationFields):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(json_schema_extra={"anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "minItems": 1, "items": {"type": "integer", "x-token-id": True}},
        {"type": "array", "minItems": 1, "maxItems": 32, "items": {"type": "string", "minLength": 1}},
        {"type": "array", "minItems": 1, "maxItems": 32,
         "items": {"type": "array", "minItems": 1, "items": {"type": "integer", "x-token-id": True}}}]})
    logprobs: int | None = in_range("logprobs")
    echo: bool | None = None
    suffix: str | None = doc(maxLength=0)
    best_of: int | None = doc(enum=[1, None])

    model_config = ConfigDict(json_schema_extra=request_rules(
        STREAM_OPTIONS_NEED_STREAM, one_constraint_at_most(False),
        either(properties(echo={"enum": [False, None]}), properties(logprobs=NULL)),
        runtime=("prompt-fits-context", "min-tokens-within-max-tokens", "grammar-compiles")))

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.suffix:
            raise unsupported("suffix")
        if self.best_of not in (None, 1):
            raise unsupported("best_of", "Use n for several completions.")

    def requested_logprobs(self) -> int | None:
        return self.logprobs

    def echoes(self) -> bool:
        return bool(self.echo)


class ChatCompletionRequest(ChatRequest):
    functions: list[dict[str, Any]] | None = doc(maxItems=0)
    function_call: str | dict[str, Any] | None = doc(enum=["none", "auto", None])
    metadata: dict[str, Any] | None = None  # metadata only
    store: bool | None = doc(enum=[False, None])
    service_tier: str | None = None
    reasoning_effort: str | None = doc(type="null")
    modalities: list[str] | None = doc(**nullable({"const": ["text"]}))
    audio: dict[str, Any] | None = doc(type="null")
    prediction: dict[str, Any] | None = doc(type="null")
    web_search_options: dict[str, Any] | None = doc(type="null")

    model_config = ConfigDict(json_schema_extra=request_rules(
        STREAM_OPTIONS_NEED_STREAM, one_constraint_at_most(True), CONTINUE_FINAL_RULE, TOOLS_NEEDED_RULE,
        either(properties(top_logprobs=NULL), set_to("logprobs", {"const": True})),
        runtime=("prompt-fits-context", "min-tokens-within-max-tokens", "grammar-compiles", "chat-template-renders",
                 "tool-names-distinct", "tool-choice-names-a-tool", "continue-final-message-after-assistant")))

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.functions:
            raise unsupported("functions", "Use tools (function calling's current form).")
        if self.function_call not in (None, "none", "auto"):
            raise unsupported("function_call", "Use tool_choice (function calling's current form).")
        if self.store:
            raise unsupported("store", "Completions are not stored.")
        if self.modalities not in (None, ["text"]):
            raise unsupported("modalities", "Only text output is produced.")
        for field in ("reasoning_effort", "audio", "prediction", "web_search_options"):
            if getattr(self, field) is not None:
                raise unsupported(field)
