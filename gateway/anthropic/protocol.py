"""The Messages API's request bodies as the gateway takes them, with the JSON Schema it documents.

Contract: ``MessagesRequest`` (``POST /v1/messages``) and ``CountTokensRequest``
(``POST /v1/messages/count_tokens``) accept every top-level field Anthropic's
API and its clients send (unknown ones are a 400 naming them). Content blocks,
tools and the choice objects are plain dicts here: ``gateway.anthropic.translate``
checks them with a 400 naming the block, and their documented schemas (the
``*_SCHEMA`` constants) say the same. Ranges are the chat request's
(``chat_field_schema``): the same checks run on them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field

from gateway.chat.request import TOOL_NAME_PATTERN
from gateway.chat.translation import chat_field_schema
from gateway.http.schema import NULL, Strict, doc, either, nullable, properties, request_rules, set_to

_OBJECT_OR_NULL = {"type": ["object", "null"]}
TEXT_BLOCK = {"type": "object", "required": ["type", "text"], "properties": {
    "type": {"const": "text"}, "text": {"type": "string"}, "cache_control": _OBJECT_OR_NULL,
    "citations": {"type": ["array", "null"]}}}
TOOL_USE_BLOCK = {"type": "object", "required": ["type", "id", "name", "input"], "properties": {
    "type": {"const": "tool_use"}, "id": {"type": "string", "minLength": 1}, "name": {"type": "string"},
    "input": {"type": "object"}, "cache_control": _OBJECT_OR_NULL}}
TOOL_RESULT_BLOCK = {"type": "object", "required": ["type", "tool_use_id"], "properties": {
    "type": {"const": "tool_result"}, "tool_use_id": {"type": "string", "minLength": 1},
    "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": TEXT_BLOCK}]},
    "is_error": {"type": ["boolean", "null"]}, "cache_control": _OBJECT_OR_NULL}}
THINKING_BLOCK = {"type": "object", "required": ["type", "thinking"], "properties": {
    "type": {"const": "thinking"}, "thinking": {"type": "string"}, "signature": {"type": ["string", "null"]}}}
REDACTED_THINKING_BLOCK = {"type": "object", "required": ["type", "data"], "properties": {
    "type": {"const": "redacted_thinking"}, "data": {"type": "string"}}}
USER_BLOCKS = (TEXT_BLOCK, TOOL_RESULT_BLOCK)
ASSISTANT_BLOCKS = (TEXT_BLOCK, TOOL_USE_BLOCK, THINKING_BLOCK, REDACTED_THINKING_BLOCK)


def _content(*blocks: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [{"type": "string"}, {"type": "array", "items": {"anyOf": list(blocks)}}]}


# The blocks a message may hold depend on its role: tool results come from the user, calls from the assistant,
# and a system message (mid-conversation instructions, as Claude Code sends them) holds text.
MESSAGE_RULE: dict[str, Any] = {"anyOf": [properties(role={"const": "user"}, content=_content(*USER_BLOCKS)),
                                          properties(role={"const": "assistant"}, content=_content(*ASSISTANT_BLOCKS)),
                                          properties(role={"const": "system"}, content=_content(TEXT_BLOCK))]}
SYSTEM_SCHEMA = nullable({"type": "string"}, {"type": "array", "items": TEXT_BLOCK})
TOOL_SCHEMA = {"type": "object", "required": ["name", "input_schema"], "properties": {
    "type": {"enum": ["custom", None]}, "name": {"type": "string", "pattern": TOOL_NAME_PATTERN},
    "description": {"type": ["string", "null"]},
    "input_schema": {"type": "object", "required": ["type"], "properties": {"type": {"const": "object"}}},
    "cache_control": _OBJECT_OR_NULL, "strict": {"type": ["boolean", "null"]}}}
_PARALLEL = {"disable_parallel_tool_use": {"type": ["boolean", "null"]}}
TOOL_CHOICE_SCHEMA = nullable(
    {"type": "object", "required": ["type"], "properties": {"type": {"const": "auto"}, **_PARALLEL}},
    {"type": "object", "required": ["type"], "properties": {"type": {"const": "any"}, **_PARALLEL}},
    {"type": "object", "required": ["type", "name"], "properties": {"type": {"const": "tool"},
                                                                    "name": {"type": "string"}, **_PARALLEL}},
    {"type": "object", "required": ["type"], "properties": {"type": {"const": "none"}}})
_DISPLAY = {"display": {"enum": ["summarized", "omitted", None]}}
THINKING_SCHEMA = nullable(
    {"type": "object", "required": ["type", "budget_tokens"], "properties": {
        "type": {"const": "enabled"}, "budget_tokens": {"type": "integer"}, **_DISPLAY}},
    {"type": "object", "required": ["type"], "properties": {"type": {"const": "disabled"}}},
    {"type": "object", "required": ["type"], "properties": {"type": {"const": "adaptive"}, **_DISPLAY}},
    {"type": "object", "required": ["type"], "properties": {"type": {"const": "between_tools"}}})
OUTPUT_FORMAT_SCHEMA = nullable({"type": "object", "required": ["type", "schema"], "properties": {
    "type": {"const": "json_schema"}, "schema": {"type": "object"}}})
OUTPUT_CONFIG_SCHEMA = nullable({"type": "object", "properties": {
    "effort": {"enum": ["low", "medium", "high", "xhigh", "max", None]}, "format": OUTPUT_FORMAT_SCHEMA}})
_FREE_TOOL_CHOICE = nullable({"type": "object", "properties": {"type": {"enum": ["auto", "none"]}}})
# A forced tool_choice constrains the output to the call: no output_config.format beside it (as chat's rule).
FORCED_TOOL_RULE = either(properties(tool_choice=_FREE_TOOL_CHOICE),
                           properties(output_config=nullable({"type": "object", "properties": {"format": NULL}})))
TOOL_CHOICE_NEEDS_TOOLS = either(properties(tool_choice=NULL), set_to("tools", {"type": "array", "minItems": 1}))
_STOP = chat_field_schema("stop")
STOP_SEQUENCES_SCHEMA = nullable(*(s for s in _STOP["anyOf"] if s.get("type") == "array"))


class AnthropicMessage(Strict):
    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]] = Field(json_schema_extra=_content(*USER_BLOCKS, *ASSISTANT_BLOCKS[1:]))

    model_config = ConfigDict(json_schema_extra=MESSAGE_RULE)


class CountTokensRequest(Strict):
    """What shapes the prompt: the fields ``count_tokens`` takes, and the start of every Messages request."""

    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = doc(**SYSTEM_SCHEMA)
    tools: list[dict[str, Any]] | None = doc(**nullable({"type": "array", "items": TOOL_SCHEMA}))
    tool_choice: dict[str, Any] | None = doc(**TOOL_CHOICE_SCHEMA)
    thinking: dict[str, Any] | None = doc(**THINKING_SCHEMA)
    output_config: dict[str, Any] | None = doc(**OUTPUT_CONFIG_SCHEMA)
    # Accepted and ignored (docs/api.md says why): they steer Anthropic's own service.
    context_management: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None
    mcp_servers: list[dict[str, Any]] | None = doc(maxItems=0)

    model_config = ConfigDict(json_schema_extra=request_rules(
        FORCED_TOOL_RULE, TOOL_CHOICE_NEEDS_TOOLS,
        runtime=("grammar-compiles", "chat-template-renders", "tool-names-distinct", "tool-choice-names-a-tool",
                 "tool-result-answers-a-tool-use")))


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(json_schema_extra=chat_field_schema("max_tokens"))
    stop_sequences: list[str] | None = doc(**STOP_SEQUENCES_SCHEMA)
    stream: bool | None = None
    temperature: float | None = doc(**chat_field_schema("temperature"))
    top_p: float | None = doc(**chat_field_schema("top_p"))
    top_k: int | None = doc(**chat_field_schema("top_k"))
    metadata: dict[str, Any] | None = None
    # Accepted and ignored: Anthropic's service options.
    service_tier: str | None = None
    inference_geo: str | None = None
    speed: str | None = None
    diagnostics: dict[str, Any] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    container: Any = doc(type="null")

    model_config = ConfigDict(json_schema_extra=request_rules(
        FORCED_TOOL_RULE, TOOL_CHOICE_NEEDS_TOOLS,
        runtime=("prompt-fits-context", "grammar-compiles", "chat-template-renders", "tool-names-distinct",
                 "tool-choice-names-a-tool", "tool-result-answers-a-tool-use")))
