"""Structured output: a request's format constraint as one llguidance grammar for the last stage.

Contract: ``grammar_for(req)`` returns the llguidance grammar (a string the stage hands to
``llguidance.LLMatcher``) for OpenAI's ``response_format`` (``json_object``: any JSON object;
``json_schema``: that schema, with or without ``strict``) or vLLM's ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar`` (Lark) and their ``structured_outputs: {"json" | "regex" | "choice" |
"grammar": ...}`` form, or None when the output is free. At most one constraint per request. A schema, regex
or grammar that llguidance cannot compile is a 400 naming the field, before any stage is asked.
``json_schema_grammar(schema, param)`` is the same for one JSON Schema (a forced tool call's, ``gateway.chat.tools``).
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

from gateway.http.errors import bad_request

from .request import ChatRequest, GenerationFields

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# Why llguidance (over xgrammar and outlines-core): it computes a row's token mask lazily, in a Rust thread pool
# that releases the GIL, so a batch mixing constrained and free rows is not stalled; it needs no PyTorch; and it
# takes JSON Schema, regexes and Lark in one engine, as vLLM and llama.cpp do (docs/api.md, "Structured output";
# docs/performance.md has the figures). JSON is compiled without flexible whitespace so a small model cannot
# spend its token budget on blank lines inside an object.
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}


def _validated(grammar: str, param: str) -> str:
    from llguidance import LLMatcher

    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise bad_request(f"{param} cannot be enforced: {error}", param)
    return grammar


def json_schema_grammar(schema: Any, param: str) -> str:
    from llguidance import LLMatcher

    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}  # JSON Schema's true / false
    if not isinstance(schema, dict):
        raise bad_request(f"{param} must be a JSON Schema object.", param)
    try:
        grammar = LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    except (ValueError, TypeError, RuntimeError) as e:
        raise bad_request(f"{param} cannot be enforced: {e}", param) from None
    return _validated(grammar, param)


def _response_format(fmt: dict[str, Any]) -> str | None:
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema_grammar({"type": "object"}, "response_format")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise bad_request("response_format.json_schema must be an object with a 'schema' (and a 'name').",
                              "response_format.json_schema")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise bad_request("response_format.json_schema.strict must be a boolean.", "response_format.json_schema")
        return json_schema_grammar(spec["schema"], "response_format.json_schema.schema")
    raise bad_request(f"response_format.type must be text, json_object or json_schema; got {kind!r}.",
                      "response_format")


def grammar_for(req: GenerationFields) -> str | None:
    from llguidance import LLMatcher

    found: list[tuple[str, str]] = []
    guided = {"json": req.guided_json, "regex": req.guided_regex, "choice": req.guided_choice,
              "grammar": req.guided_grammar}
    if req.structured_outputs is not None:
        unknown = sorted(set(req.structured_outputs) - set(guided))
        if unknown or len(req.structured_outputs) != 1:
            raise bad_request("structured_outputs must hold exactly one of json, regex, choice, grammar"
                              f"{f' (not {unknown[0]})' if unknown else ''}.", "structured_outputs")
        [(key, value)] = req.structured_outputs.items()
        if guided[key] is not None:
            raise bad_request(f"Give structured_outputs.{key} or guided_{key}, not both.", "structured_outputs")
        guided[key] = value
    if isinstance(req, ChatRequest) and req.response_format is not None:
        grammar = _response_format(req.response_format)
        if grammar is not None:
            found.append(("response_format", grammar))
    if guided["json"] is not None:
        schema = guided["json"]
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise bad_request(f"guided_json is not valid JSON: {e}", "guided_json") from None
        found.append(("guided_json", json_schema_grammar(schema, "guided_json")))
    if guided["regex"] is not None:
        if not isinstance(guided["regex"], str):
            raise bad_request("guided_regex must be a string.", "guided_regex")
        found.append(("guided_regex", _validated(LLMatcher.grammar_from_regex(guided["regex"]), "guided_regex")))
    if guided["choice"] is not None:
        choices = guided["choice"]
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
            raise bad_request("guided_choice must list at least one string.", "guided_choice")
        regex = "|".join(re.escape(c) for c in choices)
        found.append(("guided_choice", _validated(LLMatcher.grammar_from_regex(f"({regex})"), "guided_choice")))
    if guided["grammar"] is not None:
        if not isinstance(guided["grammar"], str):
            raise bad_request("guided_grammar must be a Lark grammar string.", "guided_grammar")
        found.append(("guided_grammar", _validated(LLMatcher.grammar_from_lark(guided["grammar"]),
                                                   "guided_grammar")))
    if len(found) > 1:
        raise bad_request(f"Give one output constraint, not {', '.join(p for p, _ in found)}.", found[1][0])
    return found[0][1] if found else None
