"""Structured output: a request's format constraint as one llguidance grammar for the last stage.

Contract: ``grammar_for(req, strict)`` returns the llguidance grammar (a string the stage hands to
``llguidance.LLMatcher``) for OpenAI's ``response_format`` (``json_object``: any JSON object;
``json_schema``: that schema, with or without ``strict``) or vLLM's ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar`` (Lark) and their ``structured_outputs: {"json" | "regex" | "choice" |
"grammar": ...}`` form, or None when the output is free. At most one constraint per request. A schema, regex
or grammar that llguidance cannot compile is a 400 naming the field, before any stage is asked.
``json_schema_grammar(schema, param, strict)`` is the same for one JSON Schema (a forced tool call's, ``gateway.chat.tools``).

JSON Schemas are strict unless the server runs ``--no-structured-output-strict`` (``strict=False``):
``strict_schema(schema)`` closes each object that declares ``properties`` but not ``additionalProperties``
and each tuple (``prefixItems``) without ``items``, as vLLM's xgrammar does and every agent framework assumes;
declared property order and ``required`` hold either way (llguidance's semantics). A request's
``"strict": false`` does not loosen it: the server's switch decides, as in vLLM.
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


# Keywords whose value is one subschema, a list of them, or a name -> subschema map: where strict_schema recurses.
# ``not`` and ``if`` are left as written: closing a condition or a negation would change what it admits.
_ONE = ("items", "additionalItems", "contains", "then", "else", "additionalProperties", "unevaluatedProperties",
        "unevaluatedItems")
_MANY = ("anyOf", "oneOf", "prefixItems")
_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def strict_schema(schema: Any) -> Any:
    """``schema`` with every open object that declares ``properties`` closed (``additionalProperties: false``)
    and every open tuple closed (``items: false``), recursively (pure; the input is not changed). An object
    with no ``properties`` (``{"type": "object"}``, JSON mode) declares nothing to be strict about and stays
    open. The direct members of an ``allOf`` are not closed one by one: each would refuse the others' keys, so
    the intersection would admit nothing; their own nested objects are."""
    return _strict(schema, close=True)


def _strict(schema: Any, close: bool) -> Any:
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if (key in _MANY or key == "items") and isinstance(value, list):  # draft-04 tuples: items as a list
            out[key] = [_strict(v, True) for v in value]
        elif key in _ONE:
            out[key] = _strict(value, True)
        elif key == "allOf" and isinstance(value, list):
            out[key] = [_strict(v, False) for v in value]
        elif key in _NAMED and isinstance(value, dict):
            out[key] = {name: _strict(v, True) for name, v in value.items()}
        else:
            out[key] = value
    if close and "properties" in out and not {"additionalProperties", "patternProperties",
                                              "unevaluatedProperties"} & out.keys():
        out["additionalProperties"] = False
    if close and "prefixItems" in out and not {"items", "unevaluatedItems"} & out.keys():
        out["items"] = False
    return out


def json_schema_grammar(schema: Any, param: str, strict: bool = True) -> str:
    from llguidance import LLMatcher

    if strict:
        schema = strict_schema(schema)
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}  # JSON Schema's true / false
    if not isinstance(schema, dict):
        raise bad_request(f"{param} must be a JSON Schema object.", param)
    try:
        grammar = LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    except (ValueError, TypeError, RuntimeError) as e:
        raise bad_request(f"{param} cannot be enforced: {e}", param) from None
    return _validated(grammar, param)


def _response_format(fmt: dict[str, Any], strict: bool) -> str | None:
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
        requested = spec.get("strict")
        if requested is not None and not isinstance(requested, bool):
            raise bad_request("response_format.json_schema.strict must be a boolean.", "response_format.json_schema")
        # A request's strict: true is honoured under a lax server too; its false never loosens a strict one.
        return json_schema_grammar(spec["schema"], "response_format.json_schema.schema", strict or bool(requested))
    raise bad_request(f"response_format.type must be text, json_object or json_schema; got {kind!r}.",
                      "response_format")


def grammar_for(req: GenerationFields, strict: bool = True) -> str | None:
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
        grammar = _response_format(req.response_format, strict)
        if grammar is not None:
            found.append(("response_format", grammar))
    if guided["json"] is not None:
        schema = guided["json"]
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise bad_request(f"guided_json is not valid JSON: {e}", "guided_json") from None
        found.append(("guided_json", json_schema_grammar(schema, "guided_json", strict)))
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
