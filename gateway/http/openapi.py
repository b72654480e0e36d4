"""``/openapi.json`` that tells the truth: the statuses the gateway really answers, and its limits.

Contract: ``install_openapi(app, vocab_size=..., max_model_len=...)`` replaces FastAPI's generated document
with one where no route documents FastAPI's 422 (the gateway answers 400, ``gateway.http.errors``), every route
documents the error statuses it can answer with its error envelope (OpenAI's, or the one ``error_envelopes``
names for a prefix: Anthropic's on ``/v1/messages``), streams and ``/metrics`` have their content types, and
token ids and token budgets are bounded by the served model's vocabulary and context, on top of the ranges
and cross-field rules the request models declare (``gateway.chat.request``). What JSON Schema cannot say
(``gateway.chat.request.RUNTIME_RULES``) is named in each request schema's ``x-runtime-rules`` and checked at run
time with a 400 naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorBody


_DESCRIPTIONS = {400: "Invalid request: `param` names the field to change", 401: "Missing or invalid API key",
                 404: "Unknown model or route", 413: "The body is larger than --max-request-bytes",
                 429: "Too many requests in flight (--max-concurrent-requests[-per-key]); see Retry-After",
                 500: "Server bug", 503: "No healthy replica, overloaded, or the "
                 "pipeline failed", 504: "The request outlived the server's deadline"}
_GENERATION = ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses")


def _statuses(path: str, method: str) -> list[int]:
    out = [404, 500]
    if method == "post":
        out.append(400)
    if path.startswith("/v1/") or path == "/dashboard/live":
        out.append(401)
    if path.startswith("/v1/") and method == "post":
        out += [413, 429]  # gateway.http.limits guards POST /v1/*
    if path in _GENERATION:
        out += [503, 504]
    if path == "/health":
        out.append(503)
    return sorted(out)


def decimal_below(n: int) -> str:
    """A regex for the decimal numbers 0 .. n-1 written without leading zeros (token ids as JSON object keys)."""
    top = str(n - 1)
    options = ["0"] if n > 0 else []
    if len(top) > 1:
        options.append(f"[1-9][0-9]{{0,{len(top) - 2}}}")  # the shorter numbers
    for i, digit in enumerate(top):  # same length: equal up to i, smaller at i, anything after
        low = "1" if i == 0 else "0"
        if digit > low:
            high = chr(ord(digit) - 1)
            rest = len(top) - i - 1
            options.append(top[:i] + (f"[{low}-{high}]" if high > low else low) + (f"[0-9]{{{rest}}}" if rest else ""))
    if top != "0":
        options.append(top)
    return "^(?:" + "|".join(options) + ")$"


def _bound_token_ids(node: Any, vocab_size: int, max_model_len: int) -> None:
    """Walk the request schemas: ``x-token-ids`` arrays get the vocabulary, ``x-max-tokens`` the context."""
    if isinstance(node, dict):
        if node.pop("x-token-ids", False):
            node.setdefault("items", {})["minimum"] = 0
            node["items"]["maximum"] = vocab_size - 1
        if node.pop("x-token-id", False):
            node["minimum"], node["maximum"] = 0, vocab_size - 1
        if node.pop("x-token-id-keys", False):
            node["propertyNames"] = {"pattern": decimal_below(vocab_size)}
        if node.pop("x-max-tokens", False):
            node["maximum"] = max_model_len - 1
        for value in node.values():
            _bound_token_ids(value, vocab_size, max_model_len)
    elif isinstance(node, list):
        for value in node:
            _bound_token_ids(value, vocab_size, max_model_len)


def install_openapi(app: FastAPI, *, vocab_size: int, max_model_len: int,
                    error_envelopes: Mapping[str, tuple[str, dict[str, Any]]] | None = None) -> None:
    """``error_envelopes``: path prefix -> (component name, JSON Schema) of its routes' error body.

    Error statuses per route are ``_statuses``' (400 on POST, 401 on ``/v1``, 413 and 429 on POST ``/v1``,
    503 and 504 on generation); the generation routes (completions, chat, messages, responses) answer
    ``application/json`` or ``text/event-stream``, ``/metrics`` Prometheus ``text/plain``. Token ids in
    requests (``logit_bias``'s keys too) are bounded by ``vocab_size`` and ``max_tokens`` / ``min_tokens`` by
    ``max_model_len`` (prompt + max_tokens within the context is a runtime rule).
    """
    envelopes = dict(error_envelopes or {})

    def document() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components["ErrorBody"] = ErrorBody.model_json_schema()
        components["ErrorResponse"] = {"type": "object", "required": ["error"], "additionalProperties": False,
                                       "properties": {"error": {"$ref": "#/components/schemas/ErrorBody"}}}
        components.pop("HTTPValidationError", None)
        components.pop("ValidationError", None)
        for name, envelope in envelopes.values():
            components[name] = envelope
        for path, operations in schema["paths"].items():
            name = next((n for prefix, (n, _) in envelopes.items()
                         if path == prefix or path.startswith(prefix + "/")), "ErrorResponse")
            error = {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}}
            for method, operation in operations.items():
                responses = operation["responses"]
                responses.pop("422", None)
                for status in _statuses(path, method):
                    responses[str(status)] = {"description": _DESCRIPTIONS[status], "content": error}
                ok = responses.setdefault("200", {"description": "OK"})
                if path in _GENERATION:
                    ok.setdefault("content", {})["text/event-stream"] = {"schema": {"type": "string"}}
                if path == "/metrics":
                    ok["content"] = {"text/plain": {"schema": {"type": "string"}}}
        _bound_token_ids(schema, vocab_size, max_model_len)
        app.openapi_schema = schema
        return schema

    app.openapi = document  # type: ignore[method-assign]
