"""The Responses API's request bodies as the gateway takes them, with the JSON Schema it documents.

Contract: ``ResponsesRequest`` (``POST /v1/responses``) and
``InputTokensRequest`` (``POST /v1/responses/input_tokens``) accept every
top-level field OpenAI's API and its clients (the SDKs, Codex CLI) send;
unknown ones are a 400 naming them. Input items, tools and the choice objects
are plain dicts here: ``gateway.openai_responses.translate`` checks them with
a 400 naming the item, and their documented schemas (the ``*_SCHEMA``
constants) say the same. What a stateless server cannot do (``store: true``,
``previous_response_id``, ``conversation``, ``background``, ...) is documented
as its default only and refused otherwise. Ranges are the chat request's
(``chat_field_schema``).
"""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field

from gateway.chat.request import TOOL_NAME_PATTERN
from gateway.chat.translation import chat_field_schema
from gateway.http.schema import NULL, Strict, doc, either, nullable, properties, request_rules, set_to

_STATUS = {"enum": ["in_progress", "completed", "incomplete", None]}
_TEXT_PARTS = [
    {"type": "object", "required": ["type", "text"], "properties": {
        "type": {"enum": ["input_text", "output_text"]}, "text": {"type": "string"},
        "annotations": {"type": ["array", "null"]}, "logprobs": {"type": ["array", "null"]}}},
    {"type": "object", "required": ["type", "refusal"], "properties": {
        "type": {"const": "refusal"}, "refusal": {"type": "string"}}}]
_TEXT_CONTENT = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"anyOf": _TEXT_PARTS}}]}
MESSAGE_ITEM = {"type": "object", "required": ["role", "content"], "properties": {
    "type": {"const": "message"}, "role": {"enum": ["user", "assistant", "system", "developer"]},
    "content": _TEXT_CONTENT, "id": {"type": ["string", "null"]}, "status": _STATUS,
    "phase": {"enum": ["commentary", "final_answer", None]}}}
FUNCTION_CALL_ITEM = {"type": "object", "required": ["type", "call_id", "name", "arguments"], "properties": {
    "type": {"const": "function_call"}, "call_id": {"type": "string", "minLength": 1}, "name": {"type": "string"},
    "arguments": {"type": "string"}, "namespace": {"type": ["string", "null"]}, "id": {"type": ["string", "null"]},
    "status": _STATUS}}
FUNCTION_CALL_OUTPUT_ITEM = {"type": "object", "required": ["type", "call_id", "output"], "properties": {
    "type": {"const": "function_call_output"}, "call_id": {"type": "string", "minLength": 1},
    "output": _TEXT_CONTENT, "id": {"type": ["string", "null"]}, "status": _STATUS}}
REASONING_ITEM = {"type": "object", "required": ["type", "summary"], "properties": {
    "type": {"const": "reasoning"}, "summary": {"type": "array"}, "content": {"type": ["array", "null"]},
    "encrypted_content": {"type": ["string", "null"]}, "id": {"type": ["string", "null"]}, "status": _STATUS}}
# At least one item besides reasoning (which is dropped): there is a conversation to answer.
INPUT_SCHEMA: dict[str, Any] = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"anyOf": [
    MESSAGE_ITEM, FUNCTION_CALL_ITEM, FUNCTION_CALL_OUTPUT_ITEM, REASONING_ITEM]},
    "contains": {"anyOf": [MESSAGE_ITEM, FUNCTION_CALL_ITEM, FUNCTION_CALL_OUTPUT_ITEM]}}]}
FUNCTION_TOOL = {"type": "object", "required": ["type", "name"], "properties": {
    "type": {"const": "function"}, "name": {"type": "string", "pattern": TOOL_NAME_PATTERN},
    "description": {"type": ["string", "null"]}, "parameters": nullable({"type": "object"}),
    "strict": {"type": ["boolean", "null"]}, "defer_loading": {"type": ["boolean", "null"]}}}
NAMESPACE_TOOL = {"type": "object", "required": ["type", "name", "tools"], "properties": {
    "type": {"const": "namespace"}, "name": {"type": "string", "pattern": TOOL_NAME_PATTERN},
    "description": {"type": ["string", "null"]}, "tools": {"type": "array", "minItems": 1, "items": FUNCTION_TOOL}}}
WEB_SEARCH_TYPES = ("web_search", "web_search_preview", "web_search_2025_08_26", "web_search_preview_2025_03_11")
WEB_SEARCH_TOOL = {"type": "object", "required": ["type"], "properties": {"type": {"enum": list(WEB_SEARCH_TYPES)}}}
TOOLS_SCHEMA = nullable({"type": "array", "items": {"anyOf": [FUNCTION_TOOL, NAMESPACE_TOOL, WEB_SEARCH_TOOL]}})
TOOL_CHOICE_SCHEMA = nullable({"enum": ["none", "auto", "required"]}, {
    "type": "object", "required": ["type", "name"], "properties": {"type": {"const": "function"},
                                                                   "name": {"type": "string"}}})
TEXT_FORMAT_SCHEMA = nullable(
    {"type": "object", "required": ["type"], "properties": {"type": {"const": "text"}}},
    {"type": "object", "required": ["type"], "properties": {"type": {"const": "json_object"}}},
    {"type": "object", "required": ["type", "name", "schema"], "properties": {
        "type": {"const": "json_schema"}, "name": {"type": "string"}, "schema": {"type": "object"},
        "strict": {"type": ["boolean", "null"]}, "description": {"type": ["string", "null"]}}})
TEXT_SCHEMA = nullable({"type": "object", "properties": {
    "format": TEXT_FORMAT_SCHEMA, "verbosity": {"enum": ["low", "medium", "high", None]}}})
REASONING_SCHEMA = nullable({"type": "object", "properties": {
    "effort": {"enum": ["none", "minimal", "low", "medium", "high", "xhigh", None]},
    "summary": {"enum": ["auto", "concise", "detailed", None]},
    "generate_summary": {"enum": ["auto", "concise", "detailed", None]}}})
INCLUDABLE = ("file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
              "message.input_image.image_url", "computer_call_output.output.image_url", "code_interpreter_call.outputs",
              "reasoning.encrypted_content")  # not message.output_text.logprobs: no logprobs here
_FREE_TEXT = nullable({"type": "object", "properties": {"format": nullable(
    {"type": "object", "properties": {"type": {"const": "text"}}})}})
_CALLABLE = {"type": "array", "contains": {"type": "object", "required": ["type"],
                                           "properties": {"type": {"enum": ["function", "namespace"]}}}}
_UNFORCED = properties(tool_choice={"enum": ["none", "auto", None]})
# A forced tool_choice needs a function to call, and constrains the output already (no text.format beside it).
FORCED_TOOL_RULES = (either(_UNFORCED, set_to("tools", _CALLABLE)), either(_UNFORCED, properties(text=_FREE_TEXT)))
_STREAM_OPTIONS_NEED_STREAM = either(properties(stream_options=NULL), set_to("stream", {"const": True}))


class StreamOptions(Strict):
    include_obfuscation: bool | None = None  # nothing is obfuscated


class InputTokensRequest(Strict):
    """What shapes the prompt: the fields ``input_tokens`` takes, and the start of every Responses request."""

    model: str | None = None
    input: str | list[dict[str, Any]] = Field(json_schema_extra=INPUT_SCHEMA)
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = doc(**TOOLS_SCHEMA)
    tool_choice: str | dict[str, Any] | None = doc(**TOOL_CHOICE_SCHEMA)
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = doc(**TEXT_SCHEMA)
    reasoning: dict[str, Any] | None = doc(**REASONING_SCHEMA)
    # Refused unless at their default: they need responses kept on the server.
    previous_response_id: str | None = doc(type="null")
    conversation: Any = doc(type="null")
    truncation: str | None = doc(enum=["disabled", None])

    model_config = ConfigDict(json_schema_extra=request_rules(
        *FORCED_TOOL_RULES,
        runtime=("grammar-compiles", "tool-names-distinct", "tool-choice-names-a-tool",
                 "function-call-output-answers-a-call", "namespaced-names-fit")))


class ResponsesRequest(InputTokensRequest):
    max_output_tokens: int | None = doc(**chat_field_schema("max_tokens"))
    temperature: float | None = doc(**chat_field_schema("temperature"))
    top_p: float | None = doc(**chat_field_schema("top_p"))
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    include: list[str] | None = doc(**nullable({"type": "array", "items": {"enum": list(INCLUDABLE)}}))
    # prompt_cache_key: the prefix cache's replica choice (gateway.mesh.replica_client); the rest is metadata.
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    metadata: dict[str, Any] | None = None
    client_metadata: dict[str, Any] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    context_management: list[dict[str, Any]] | None = None
    # Refused unless at their default.
    store: bool | None = doc(enum=[False, None])
    background: bool | None = doc(enum=[False, None])
    top_logprobs: int | None = doc(enum=[0, None])
    max_tool_calls: int | None = doc(type="null")
    prompt: dict[str, Any] | None = doc(type="null")

    model_config = ConfigDict(json_schema_extra=request_rules(
        *FORCED_TOOL_RULES, _STREAM_OPTIONS_NEED_STREAM,
        runtime=("prompt-fits-context", "grammar-compiles", "tool-names-distinct", "tool-choice-names-a-tool",
                 "function-call-output-answers-a-call", "namespaced-names-fit")))
