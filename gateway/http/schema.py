"""The request models' documented JSON Schema: the pieces every API's request bodies are described with.

Contract: ``Strict`` is a request body that refuses unknown fields (a 400 naming them). ``doc(**schema)`` is an
optional field whose documented schema gains ``schema``; ``nullable``, ``either``, ``properties`` and
``set_to`` write the rules between fields as plain ``anyOf`` / ``properties`` / ``required``, which every
JSON Schema validator and generator reads alike. These only *describe*: the run-time checks live with each
API and the chat core, each a 400 naming the field. ``request_rules(*rules, runtime=...)`` is a model's
``json_schema_extra``: its cross-field rules and, in ``x-runtime-rules``, the names of what JSON Schema cannot
say (``RUNTIME_RULES``, listed in docs/api.md).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

NULL: dict[str, Any] = {"type": "null"}


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def doc(**schema: Any) -> Any:
    """An optional field whose documented JSON Schema gains ``schema`` (the run-time checks are elsewhere)."""
    return Field(default=None, json_schema_extra=schema)


def nullable(*schemas: dict[str, Any]) -> dict[str, Any]:
    """A field's whole documented schema: one of ``schemas``, or null (its default)."""
    return {"anyOf": [*schemas, NULL]}


def either(*alternatives: dict[str, Any]) -> dict[str, Any]:
    """A rule between fields, as alternatives of per-field restrictions ("A implies B" is "not A, or B")."""
    return {"anyOf": list(alternatives)}


def properties(**schemas: dict[str, Any]) -> dict[str, Any]:
    return {"properties": schemas}


def set_to(field: str, schema: dict[str, Any]) -> dict[str, Any]:
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


def request_rules(*rules: dict[str, Any], runtime: tuple[str, ...]) -> dict[str, Any]:
    """A model's ``json_schema_extra``: the cross-field rules, and the names of those only checked at run time."""
    return {"allOf": list(rules), "x-runtime-rules": [{"rule": r, "description": RUNTIME_RULES[r]} for r in runtime]}
