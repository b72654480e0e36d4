"""The chat request every API's request becomes: the core's one request vocabulary, in no API's terms.

Contract: ``GenerationFields`` are the fields of a generation every request kind shares (sampling, stop
strings, streaming, vLLM's extras, the output constraints); ``ChatRequest`` adds the conversation
(``ChatMessage``s), the chat template's options and the tools. The OpenAI bodies extend them
(``gateway.openai.schemas``), and the other APIs are translated into a ``ChatRequest``
(``gateway.chat.translation``). Like every request model these only *type* the JSON and *describe* ranges
and rules in JSON Schema; what is in range, supported, or fits is decided once, by the core
(``gateway.chat.sampling``, ``gateway.chat.plan``). A request kind says what is its own through four hooks
(``refuse_unsupported``, ``requested_logprobs``, ``token_budget``, ``echoes``), so the core never names
an API. Fields accepted at their default only are ``DEFAULT_ONLY``.
"""

from __future__ import annotations

from typing import Any, ClassVar, cast

from pydantic import BaseModel, ConfigDict, Field

from gateway.http.errors import bad_request, unsupported
from gateway.http.schema import NULL, Strict, doc, either, nullable, properties, set_to
from stagemesh_core import sampling

# The request's own limits (the sampling fields' ranges are the core's: stagemesh_core.sampling.RANGES).
MAX_N = 16  # choices per prompt
MAX_STOP_STRINGS = 4
MAX_STOP_TOKEN_IDS = 64


# The documented ranges are the core's (stagemesh_core.sampling.RANGES, which gateway.chat.sampling enforces)
# and the request limits above, only described here (json_schema_extra), so /openapi.json is as tight as the
# validation while the 400s keep their own wording; gateway.http.openapi adds the served model's vocabulary and
# context bounds.
def _bounds(field: str) -> dict[str, Any]:
    """The JSON Schema bounds of a core sampling field's range (``stagemesh_core.sampling.RANGES``)."""
    allowed = sampling.RANGES[field]
    return {"exclusiveMinimum" if allowed.low_open else "minimum": allowed.low, "maximum": allowed.high}


def in_range(field: str, **schema: Any) -> Any:
    """An optional field documented with its core range (and ``schema``)."""
    return doc(**_bounds(field), **schema)


TOKEN_IDS: dict[str, Any] = {"x-token-ids": True}
_ROLES = ["system", "developer", "user", "assistant", "tool"]
CONSTRAINTS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")
JSON_SCHEMA = {"type": ["object", "boolean"]}
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
# vLLM fields accepted only at their default: field -> (default, why); refuse_unsupported refuses the rest.
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
    return doc(type="null") if default is None else doc(enum=[default, None])


def one_constraint_at_most(with_response_format: bool) -> dict[str, Any]:
    """``gateway.chat.grammar``: one output constraint at most; ``gateway.chat.sampling`` and
    ``gateway.chat.plan``: none with ``ignore_eos``, ``min_tokens`` >= 1 or a forced ``tool_choice``."""
    free: dict[str, dict[str, Any]] = {f: NULL for f in CONSTRAINTS}
    if with_response_format:
        free["response_format"] = {"anyOf": [NULL, {"type": "object", "properties": {"type": {"const": "text"}}}]}
    unforced: dict[str, dict[str, Any]] = {"ignore_eos": {"enum": [False, None]}, "min_tokens": {"maximum": 0},
                "tool_choice": {"enum": ["none", "auto", None]}}
    only = [properties(**{**free, **{k: {} for k in free if k == kept}}, **unforced) for kept in free]
    return either(properties(**free), *only)


STREAM_OPTIONS_NEED_STREAM = either(properties(stream_options=NULL), set_to("stream", {"const": True}))
CONTINUE_FINAL_RULE = either(properties(continue_final_message={"enum": [False, None]}),
                             properties(add_generation_prompt={"enum": [False, None]}))
TOOLS_NEEDED_RULE = either(properties(tool_choice=NULL, parallel_tool_calls=NULL),
                           set_to("tools", {"type": "array", "minItems": 1}))
CHAT_TEMPLATE_SCHEMA = nullable({"type": "string", "pattern": "\\S"})
CHAT_TEMPLATE_KWARGS_SCHEMA = nullable({"type": "object",
                                        "propertyNames": {"not": {"enum": list(RESERVED_TEMPLATE_KWARGS)}}})
TOOLS_SCHEMA = nullable({"type": "array", "items": _TOOL})


class StreamOptions(Strict):
    # Its OpenAPI component is named by its module (the Responses API has a StreamOptions too): the name
    # /openapi.json has always published.
    __module__ = "gateway.schemas"

    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # we never obfuscate; accepted for SDK compatibility


class GenerationFields(Strict):
    model: str | None = None
    max_tokens: int | None = doc(minimum=1, **{"x-max-tokens": True})
    temperature: float | None = in_range("temperature")
    top_p: float | None = in_range("top_p")
    n: int | None = doc(minimum=1, maximum=MAX_N)
    # 2**63 - 1024: the largest double below 2**63, so a JSON number the schema admits is a signed 64-bit
    # integer however the client's JSON reads it (2**63 - 1 as a double is 2**63, out of range).
    seed: int | None = doc(minimum=-(2**63), maximum=2**63 - 1024)
    stop: str | list[str] | None = doc(anyOf=[{"type": "string", "minLength": 1},
                                               {"type": "array", "maxItems": MAX_STOP_STRINGS,
                                                "items": {"type": "string", "minLength": 1}},
                                               {"type": "null"}])
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # metadata only
    presence_penalty: float | None = in_range("presence_penalty")
    frequency_penalty: float | None = in_range("frequency_penalty")
    logit_bias: dict[str, float] | None = doc(maxProperties=sampling.MAX_LOGIT_BIAS, **{"x-token-id-keys": True},
                                               additionalProperties={"type": "number", **_bounds("logit_bias")})
    # vLLM's extra sampling parameters (docs/api.md lists each with its range and default).
    top_k: int | None = doc(minimum=-1, maximum=sampling.RANGES["top_k"].high)  # -1, as 0, disables
    min_p: float | None = in_range("min_p")
    repetition_penalty: float | None = in_range("repetition_penalty")
    min_tokens: int | None = doc(minimum=0, **{"x-max-tokens": True})
    stop_token_ids: list[int] | None = doc(maxItems=MAX_STOP_TOKEN_IDS, **TOKEN_IDS)
    ignore_eos: bool | None = None
    allowed_token_ids: list[int] | None = doc(**TOKEN_IDS)
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    add_special_tokens: bool | None = None
    request_id: str | None = None  # metadata only
    # vLLM's fields accepted only at their defaults (checked in gateway.chat.sampling).
    spaces_between_special_tokens: bool | None = _default_only("spaces_between_special_tokens")
    use_beam_search: bool | None = _default_only("use_beam_search")
    length_penalty: float | None = _default_only("length_penalty")
    prompt_logprobs: int | None = _default_only("prompt_logprobs")
    truncate_prompt_tokens: int | None = _default_only("truncate_prompt_tokens")
    priority: int | None = _default_only("priority")
    bad_words: list[str] | None = doc(maxItems=0)
    guided_json: Any = doc(**nullable(JSON_SCHEMA, {"type": "string", "contentMediaType": "application/json"}))
    guided_regex: str | None = None
    guided_choice: list[str] | None = doc(minItems=1)
    guided_grammar: str | None = None
    # vLLM's newer form: {"json" | "regex" | "choice" | "grammar": ...}
    structured_outputs: dict[str, Any] | None = doc(**nullable({
        "type": "object", "minProperties": 1, "maxProperties": 1,
        "propertyNames": {"enum": ["json", "regex", "choice", "grammar"]},
        "properties": {"json": {"anyOf": [JSON_SCHEMA, {"type": "string", "contentMediaType": "application/json"}]},
                       "regex": {"type": "string"}, "grammar": {"type": "string"},
                       "choice": {"type": "array", "minItems": 1, "items": {"type": "string"}}}}))
    return_tokens_as_token_ids: bool | None = _default_only("return_tokens_as_token_ids")

    # The request kind's own: a kind (chat, a completion) overrides what differs.
    LOGPROBS_FIELD: ClassVar[str] = "logprobs"  # the field that asks for top logprobs, for error messages

    def refuse_unsupported(self) -> None:
        """A 400 for every field set to something the stages cannot do."""
        for field, (default, why) in DEFAULT_ONLY.items():
            value = getattr(self, field)
            if value is not None and value != default:
                raise unsupported(field, why)
        if self.bad_words:
            raise unsupported("bad_words", "Use logit_bias with -100 for the tokens to avoid.")

    def requested_logprobs(self) -> int | None:
        """How many top logprobs the request asks for (None: no logprobs; the core checks the range)."""
        return None

    def token_budget(self) -> tuple[int | None, str]:
        """The token budget asked for, and the field that asked (for error messages)."""
        return self.max_tokens, "max_tokens"

    def echoes(self) -> bool:
        """The prompt's text comes back before the completion."""
        return False


class ChatMessage(BaseModel):
    # Clients often send back the assistant message object they received
    # (with refusal/annotations/audio nulls), so unknown keys are tolerated here.
    role: str = Field(json_schema_extra={"enum": cast(Any, _ROLES)})
    content: str | list[dict[str, Any]] | None = doc(**nullable({"type": "string"}, {"type": "array", "items": {
        "type": "object", "required": ["type", "text"],
        "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}))
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = doc(**nullable({"type": "array", "items": {
        "type": "object", "required": ["function"], "properties": {"function": {
            "type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}}}))
    tool_call_id: str | None = None

    # gateway.chat.template: content may be left out only by the assistant, which alone makes tool calls.
    model_config = ConfigDict(extra="ignore", json_schema_extra=either(
        properties(role={"const": "assistant"}),
        {"required": ["content"], "properties": {"content": {"type": ["string", "array"]}, "tool_calls": {
            "anyOf": [NULL, {"type": "array", "maxItems": 0}]}}}))


class ChatRequest(GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    # vLLM's chat extensions: the template, its variables, how the prompt ends.
    chat_template: str | None = doc(**CHAT_TEMPLATE_SCHEMA)
    chat_template_kwargs: dict[str, Any] | None = doc(**CHAT_TEMPLATE_KWARGS_SCHEMA)
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    max_completion_tokens: int | None = doc(minimum=1, **{"x-max-tokens": True})
    logprobs: bool | None = None
    top_logprobs: int | None = in_range("logprobs")
    response_format: dict[str, Any] | None = doc(**nullable(
        {"type": "object", "properties": {"type": {"const": "text"}}},
        {"type": "object", "required": ["type"], "properties": {"type": {"const": "json_object"}}},
        {"type": "object", "required": ["type", "json_schema"], "properties": {
            "type": {"const": "json_schema"},
            "json_schema": {"type": "object", "required": ["schema"], "properties": {
                "name": {"type": "string"}, "schema": JSON_SCHEMA, "strict": {"type": ["boolean", "null"]}}}}}))
    tools: list[dict[str, Any]] | None = doc(**TOOLS_SCHEMA)
    tool_choice: str | dict[str, Any] | None = doc(**nullable(
        {"enum": ["none", "auto", "required"]},
        {"type": "object", "required": ["type", "function"], "properties": {
            "type": {"const": "function"},
            "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}}))
    parallel_tool_calls: bool | None = None

    LOGPROBS_FIELD: ClassVar[str] = "top_logprobs"

    def requested_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true.", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def token_budget(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"  # the newer name wins
        return self.max_tokens, "max_tokens"
