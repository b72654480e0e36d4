"""Pydantic request models of the OpenAI endpoints the gateway serves.

Contract: these models only *type* the JSON (so FastAPI can turn a malformed body into a 400 and
/openapi.json documents the API). Unknown top-level fields are rejected (OpenAI does the same), never silently
ignored. Whether a value is in range, supported, or fits the context is decided in one place,
``gateway.chat.sampling`` (and the prompt modules), so every message about a field comes from there; here
the ranges, limits and rules between fields are only *described*, in JSON Schema, so that a request the
document calls valid is accepted. Fields we accept but cannot honour are declared with their OpenAI default
(``DEFAULT_ONLY``) so that sending the default stays legal. ``RUNTIME_RULES`` names what JSON Schema cannot say.
"""

from __future__ import annotations

from typing import Any, cast

from pydantic import BaseModel, ConfigDict, Field

from stagemesh_core import sampling

# The request's own limits (the sampling fields' ranges are the core's: stagemesh_core.sampling.RANGES).
MAX_N = 16  # choices per prompt
MAX_STOP_STRINGS = 4
MAX_STOP_TOKEN_IDS = 64


# The documented ranges are the core's (stagemesh_core.sampling.RANGES, which gateway.chat.sampling enforces)
# and the request limits above, only described here (json_schema_extra), so /openapi.json is as tight as the
# validation while the 400s keep their own wording; gateway.http.openapi adds the served model's vocabulary and
# context bounds. The rules between fields (stream_options needs stream, one output constraint at most, a
# message's content by role, ...) are said in JSON Schema too (``_either``).
def _doc(**schema: Any) -> Any:
    """An optional field whose documented JSON Schema gains ``schema`` (the run-time checks are elsewhere)."""
    return Field(default=None, json_schema_extra=schema)


def _bounds(field: str) -> dict[str, Any]:
    """The JSON Schema bounds of a core sampling field's range (``stagemesh_core.sampling.RANGES``)."""
    allowed = sampling.RANGES[field]
    return {"exclusiveMinimum" if allowed.low_open else "minimum": allowed.low, "maximum": allowed.high}


def _in_range(field: str, **schema: Any) -> Any:
    """An optional field documented with its core range (and ``schema``)."""
    return _doc(**_bounds(field), **schema)


TOKEN_IDS: dict[str, Any] = {"x-token-ids": True}
_ROLES = ["system", "developer", "user", "assistant", "tool"]
_NULL = {"type": "null"}


def _nullable(*schemas: dict[str, Any]) -> dict[str, Any]:
    """A field's whole documented schema: one of ``schemas``, or null (its default)."""
    return {"anyOf": [*schemas, _NULL]}


def _either(*alternatives: dict[str, Any]) -> dict[str, Any]:
    """A rule between fields, as alternatives of per-field restrictions ("A implies B" is "not A, or B"):
    plain ``properties`` and ``required``, which every JSON Schema validator and generator reads alike."""
    return {"anyOf": list(alternatives)}


def _fields(**schemas: dict[str, Any]) -> dict[str, Any]:
    return {"properties": schemas}


def _set_to(field: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"required": [field], "properties": {field: schema}}


# What JSON Schema cannot say about a request, each checked at run time with a 400 naming the field; each
# request schema names its rules in ``x-runtime-rules``, and docs/api.md lists them.
RUNTIME_RULES = {
    "prompt-fits-context": "Each prompt encodes to at least one token (the tokenizer drops some control "
                           "characters), and its tokens (as the chat template renders it) plus max_tokens (or "
                           "max_completion_tokens; 1 when unset) are at most the context (max_model_len).",
    "min-tokens-within-max-tokens": "min_tokens is at most the max_tokens (max_completion_tokens) sent.",
    "grammar-compiles": "guided_json, guided_regex, guided_grammar, structured_outputs, response_format's "
                        "json_schema and, with a forced tool_choice, the tools' parameters compile with llguidance.",
    "chat-template-renders": "A chat_template renders these messages (and its rendered prompt is not empty); "
                             "with continue_final_message, what it renders holds the final message's content.",
    "tool-names-distinct": "The tools' function names are distinct.",
    "tool-choice-names-a-tool": "A named tool_choice names one of the tools.",
    "continue-final-message-after-assistant": "continue_final_message needs the last message to be the "
                                              "assistant's.",
    # The Messages API (gateway.anthropic) and the Responses API (gateway.openai_responses).
    "tool-result-answers-a-tool-use": "Each tool_result's tool_use_id is the id of a tool_use block in the "
                                      "assistant message just before it.",
    "function-call-output-answers-a-call": "Each function_call_output's call_id is the call_id of a function_call "
                                           "earlier in input.",
    "namespaced-names-fit": "A namespace's functions are offered to the model as <namespace>__<name>, which is at "
                            "most 64 characters.",
}
_CONSTRAINTS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")
_JSON_SCHEMA = {"type": ["object", "boolean"]}
TOOL_NAME_PATTERN = "^[a-zA-Z0-9_-]{1,64}$"  # gateway.chat.tools checks it
_TOOL_NAME = {"type": "string", "pattern": TOOL_NAME_PATTERN}
_TOOL = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": _TOOL_NAME, "description": {"type": ["string", "null"]}, "parameters": {"type": "object"}}}}}
# Names apply_chat_template itself takes: a template variable of that name would be ambiguous (gateway.chat.template
# refuses them in chat_template_kwargs).
RESERVED_TEMPLATE_KWARGS = ("conversation", "messages", "tools", "documents", "chat_template", "tokenize",
                            "add_generation_prompt", "continue_final_message", "return_tensors", "return_dict",
                            "padding", "truncation", "max_length", "tokenizer_kwargs")
# vLLM fields accepted only at their default: field -> (default, why); gateway.chat.sampling refuses the rest.
DEFAULT_ONLY: dict[str, tuple[object, str]] = {
    "spaces_between_special_tokens": (True, "Special tokens are decoded without extra spaces."),
    "use_beam_search": (False, "Beam search is not implemented."),
    "length_penalty": (1.0, "It applies to beam search, which is not implemented."),
    "prompt_logprobs": (None, "The prompt's logprobs are not computed."),
    "truncate_prompt_tokens": (None, "Prompts are never truncated; shorten the prompt."),
    "priority": (0, "Requests are served in arrival order."),
    "return_tokens_as_token_ids": (False, "Logprobs name tokens by their text."),
}


def _default_only(field: str) -> Any:
    default = DEFAULT_ONLY[field][0]
    return _doc(type="null") if default is None else _doc(enum=[default, None])


def _one_constraint_at_most(with_response_format: bool) -> dict[str, Any]:
    """``gateway.chat.grammar``: one output constraint at most; ``gateway.chat.sampling`` and
    ``gateway.openai.serving``: none with ``ignore_eos``, ``min_tokens`` >= 1 or a forced ``tool_choice``."""
    free: dict[str, dict[str, Any]] = {f: _NULL for f in _CONSTRAINTS}
    if with_response_format:
        free["response_format"] = {"anyOf": [_NULL, {"type": "object", "properties": {"type": {"const": "text"}}}]}
    unforced: dict[str, dict[str, Any]] = {"ignore_eos": {"enum": [False, None]}, "min_tokens": {"maximum": 0},
                "tool_choice": {"enum": ["none", "auto", None]}}
    only = [_fields(**{**free, **{k: {} for k in free if k == kept}}, **unforced) for kept in free]
    return _either(_fields(**free), *only)


def request_rules(*rules: dict[str, Any], runtime: tuple[str, ...]) -> dict[str, Any]:
    """A model's ``json_schema_extra``: the cross-field rules, and the names of those only checked at run time."""
    return {"allOf": list(rules), "x-runtime-rules": [{"rule": r, "description": RUNTIME_RULES[r]} for r in runtime]}


_STREAM_OPTIONS_NEED_STREAM = _either(_fields(stream_options=_NULL), _set_to("stream", {"const": True}))
CONTINUE_FINAL_RULE = _either(_fields(continue_final_message={"enum": [False, None]}),
                              _fields(add_generation_prompt={"enum": [False, None]}))
TOOLS_NEEDED_RULE = _either(_fields(tool_choice=_NULL, parallel_tool_calls=_NULL),
                            _set_to("tools", {"type": "array", "minItems": 1}))
CHAT_TEMPLATE_SCHEMA = _nullable({"type": "string", "pattern": "\\S"})
CHAT_TEMPLATE_KWARGS_SCHEMA = _nullable({"type": "object",
                                         "propertyNames": {"not": {"enum": list(RESERVED_TEMPLATE_KWARGS)}}})
TOOLS_SCHEMA = _nullable({"type": "array", "items": _TOOL})


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # we never obfuscate; accepted for SDK compatibility


class _CommonRequest(_Strict):
    model: str | None = None
    max_tokens: int | None = _doc(minimum=1, **{"x-max-tokens": True})
    temperature: float | None = _in_range("temperature")
    top_p: float | None = _in_range("top_p")
    n: int | None = _doc(minimum=1, maximum=MAX_N)
    # 2**63 - 1024: the largest double below 2**63, so a JSON number the schema admits is a signed 64-bit
    # integer however the client's JSON reads it (2**63 - 1 as a double is 2**63, out of range).
    seed: int | None = _doc(minimum=-(2**63), maximum=2**63 - 1024)
    stop: str | list[str] | None = _doc(anyOf=[{"type": "string", "minLength": 1},
                                               {"type": "array", "maxItems": MAX_STOP_STRINGS,
                                                "items": {"type": "string", "minLength": 1}},
                                               {"type": "null"}])
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # metadata only
    presence_penalty: float | None = _in_range("presence_penalty")
    frequency_penalty: float | None = _in_range("frequency_penalty")
    logit_bias: dict[str, float] | None = _doc(maxProperties=sampling.MAX_LOGIT_BIAS, **{"x-token-id-keys": True},
                                               additionalProperties={"type": "number", **_bounds("logit_bias")})
    # vLLM's extra sampling parameters (docs/api.md lists each with its range and default).
    top_k: int | None = _doc(minimum=-1, maximum=sampling.RANGES["top_k"].high)  # -1, as 0, disables
    min_p: float | None = _in_range("min_p")
    repetition_penalty: float | None = _in_range("repetition_penalty")
    min_tokens: int | None = _doc(minimum=0, **{"x-max-tokens": True})
    stop_token_ids: list[int] | None = _doc(maxItems=MAX_STOP_TOKEN_IDS, **TOKEN_IDS)
    ignore_eos: bool | None = None
    allowed_token_ids: list[int] | None = _doc(**TOKEN_IDS)
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    add_special_tokens: bool | None = None
    request_id: str | None = None  # metadata only
    # vLLM's fields accepted only at their defaults (checked in sampling_params).
    spaces_between_special_tokens: bool | None = _default_only("spaces_between_special_tokens")
    use_beam_search: bool | None = _default_only("use_beam_search")
    length_penalty: float | None = _default_only("length_penalty")
    prompt_logprobs: int | None = _default_only("prompt_logprobs")
    truncate_prompt_tokens: int | None = _default_only("truncate_prompt_tokens")
    priority: int | None = _default_only("priority")
    bad_words: list[str] | None = _doc(maxItems=0)
    guided_json: Any = _doc(**_nullable(_JSON_SCHEMA, {"type": "string", "contentMediaType": "application/json"}))
    guided_regex: str | None = None
    guided_choice: list[str] | None = _doc(minItems=1)
    guided_grammar: str | None = None
    # vLLM's newer form: {"json" | "regex" | "choice" | "grammar": ...}
    structured_outputs: dict[str, Any] | None = _doc(**_nullable({
        "type": "object", "minProperties": 1, "maxProperties": 1,
        "propertyNames": {"enum": ["json", "regex", "choice", "grammar"]},
        "properties": {"json": {"anyOf": [_JSON_SCHEMA, {"type": "string", "contentMediaType": "application/json"}]},
                       "regex": {"type": "string"}, "grammar": {"type": "string"},
                       "choice": {"type": "array", "minItems": 1, "items": {"type": "string"}}}}))
    return_tokens_as_token_ids: bool | None = _default_only("return_tokens_as_token_ids")


class CompletionRequest(_CommonRequest):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(json_schema_extra={"anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "minItems": 1, "items": {"type": "integer", "x-token-id": True}},
        {"type": "array", "minItems": 1, "maxItems": 32, "items": {"type": "string", "minLength": 1}},
        {"type": "array", "minItems": 1, "maxItems": 32,
         "items": {"type": "array", "minItems": 1, "items": {"type": "integer", "x-token-id": True}}}]})
    logprobs: int | None = _in_range("logprobs")
    echo: bool | None = None
    suffix: str | None = _doc(maxLength=0)
    best_of: int | None = _doc(enum=[1, None])

    model_config = ConfigDict(json_schema_extra=request_rules(
        _STREAM_OPTIONS_NEED_STREAM, _one_constraint_at_most(False),
        _either(_fields(echo={"enum": [False, None]}), _fields(logprobs=_NULL)),
        runtime=("prompt-fits-context", "min-tokens-within-max-tokens", "grammar-compiles")))


class ChatMessage(BaseModel):
    # Clients often send back the assistant message object they received
    # (with refusal/annotations/audio nulls), so unknown keys are tolerated here.
    role: str = Field(json_schema_extra={"enum": cast(Any, _ROLES)})
    content: str | list[dict[str, Any]] | None = _doc(**_nullable({"type": "string"}, {"type": "array", "items": {
        "type": "object", "required": ["type", "text"],
        "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}))
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = _doc(**_nullable({"type": "array", "items": {
        "type": "object", "required": ["function"], "properties": {"function": {
            "type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}}}))
    tool_call_id: str | None = None

    # gateway.chat.template: content may be left out only by the assistant, which alone makes tool calls.
    model_config = ConfigDict(extra="ignore", json_schema_extra=_either(
        _fields(role={"const": "assistant"}),
        {"required": ["content"], "properties": {"content": {"type": ["string", "array"]}, "tool_calls": {
            "anyOf": [_NULL, {"type": "array", "maxItems": 0}]}}}))


class ChatCompletionRequest(_CommonRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    # vLLM's chat extensions: the template, its variables, how the prompt ends.
    chat_template: str | None = _doc(**CHAT_TEMPLATE_SCHEMA)
    chat_template_kwargs: dict[str, Any] | None = _doc(**CHAT_TEMPLATE_KWARGS_SCHEMA)
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    max_completion_tokens: int | None = _doc(minimum=1, **{"x-max-tokens": True})
    logprobs: bool | None = None
    top_logprobs: int | None = _in_range("logprobs")
    response_format: dict[str, Any] | None = _doc(**_nullable(
        {"type": "object", "properties": {"type": {"const": "text"}}},
        {"type": "object", "required": ["type"], "properties": {"type": {"const": "json_object"}}},
        {"type": "object", "required": ["type", "json_schema"], "properties": {
            "type": {"const": "json_schema"},
            "json_schema": {"type": "object", "required": ["schema"], "properties": {
                "name": {"type": "string"}, "schema": _JSON_SCHEMA, "strict": {"type": ["boolean", "null"]}}}}}))
    tools: list[dict[str, Any]] | None = _doc(**TOOLS_SCHEMA)
    tool_choice: str | dict[str, Any] | None = _doc(**_nullable(
        {"enum": ["none", "auto", "required"]},
        {"type": "object", "required": ["type", "function"], "properties": {
            "type": {"const": "function"},
            "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}}))
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = _doc(maxItems=0)
    function_call: str | dict[str, Any] | None = _doc(enum=["none", "auto", None])
    metadata: dict[str, Any] | None = None  # metadata only
    store: bool | None = _doc(enum=[False, None])
    service_tier: str | None = None
    reasoning_effort: str | None = _doc(type="null")
    modalities: list[str] | None = _doc(**_nullable({"const": ["text"]}))
    audio: dict[str, Any] | None = _doc(type="null")
    prediction: dict[str, Any] | None = _doc(type="null")
    web_search_options: dict[str, Any] | None = _doc(type="null")

    model_config = ConfigDict(json_schema_extra=request_rules(
        _STREAM_OPTIONS_NEED_STREAM, _one_constraint_at_most(True), CONTINUE_FINAL_RULE, TOOLS_NEEDED_RULE,
        _either(_fields(top_logprobs=_NULL), _set_to("logprobs", {"const": True})),
        runtime=("prompt-fits-context", "min-tokens-within-max-tokens", "grammar-compiles", "chat-template-renders",
                 "tool-names-distinct", "tool-choice-names-a-tool", "continue-final-message-after-assistant")))
