"""OpenAI-shaped errors: one exception type, one JSON envelope, every handler.

Contract:
- ``APIError(status, message, param=..., code=...)`` is the only exception the
  gateway raises for an expected failure. Its body is OpenAI's envelope
  ``{"error": {"message", "type", "param", "code"}}`` (``type`` follows OpenAI:
  ``invalid_request_error``, ``authentication_error``, ``server_error``;
  ``code`` is a short string or null, as OpenAI does).
- 5xx errors that a retry cannot fix carry ``x-should-retry: false`` so the
  openai SDK does not resend a (costly, non-idempotent) generation.
- ``install_error_handlers(app)`` makes FastAPI speak the envelope everywhere:
  request validation (malformed JSON, wrong types, non-object bodies) becomes
  400 rather than FastAPI's 422, unknown routes 404, wrong methods 405, and an
  unexpected exception a 500 that says it is ours, not the client's.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("stagemesh.gateway")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "invalid_request_error", 405: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error"}


class APIError(Exception):
    """An error the client gets as an OpenAI envelope with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        should_retry: bool | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.should_retry = should_retry

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {} if self.should_retry is None else {"x-should-retry": "true" if self.should_retry else "false"}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers())


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def unsupported(field: str, why: str = "") -> APIError:
    detail = f" {why}" if why else ""
    return APIError(400, f"'{field}' is not supported by this server.{detail}", param=field,
                    code="unsupported_parameter")


def model_not_found(name: str, served: str) -> APIError:
    return APIError(404, f"The model `{name}` does not exist. Valid models: `{served}`.", param="model",
                    code="model_not_found")


def unauthorized() -> APIError:
    return APIError(401, "Missing or invalid API key: send `Authorization: Bearer <key>` (or `x-api-key: <key>`).",
                    code="invalid_api_key")


def no_healthy_replica() -> APIError:
    # Retrying is right: the coordinator replaces a failed replica.
    return APIError(503, "No healthy replica can serve the request right now; the mesh is starting or recovering.",
                    code="no_healthy_replica", should_retry=True)


def overloaded(detail: str = "") -> APIError:
    message = "The server is overloaded or not ready yet." + (f" ({detail})" if detail else "")
    return APIError(503, message, code="overloaded", should_retry=True)


def pipeline_failed(detail: str) -> APIError:
    # Tokens may already have been spent; a blind resend is the client's call, not the SDK's.
    return APIError(503, f"The pipeline failed while serving the request: {detail}", code="pipeline_failed",
                    should_retry=False)


def timed_out(seconds: float) -> APIError:
    return APIError(504, f"The request did not finish within the server's {seconds:g} s deadline.",
                    code="timeout", should_retry=False)


def internal(detail: str) -> APIError:
    return APIError(500, f"Internal server error: {detail}", code="internal_error", should_retry=False)


def _is_type_tag(part: Any) -> bool:
    # pydantic puts the union member it tried into ``loc``: "str", "list[int]", "function-after[...]".
    return isinstance(part, str) and (part in {"str", "int", "float", "bool", "dict", "list"} or "[" in part)


def _param_of(loc: tuple[Any, ...]) -> str | None:
    """``("body", "messages", 0, "content", "str")`` -> ``"messages[0].content"``."""
    out = ""
    for part in loc:
        if part == "body" or _is_type_tag(part):
            continue
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None


def validation_error(exc: RequestValidationError, request: Request) -> APIError:
    """One readable 400 from pydantic's errors; ``param`` is the first offending field."""
    errors = list(exc.errors())
    content_type = request.headers.get("content-type", "")
    if errors and errors[0].get("type") == "json_invalid":
        why = (errors[0].get("ctx") or {}).get("error", "invalid JSON")
        return bad_request(f"The request body is not valid JSON: {why}.", code="invalid_json")
    if "json" not in content_type.lower() and any(
            isinstance(e.get("input"), (bytes, str)) and tuple(e.get("loc", ())) == ("body",) for e in errors):
        got = content_type or "none"
        return bad_request(f"Expected a JSON body with Content-Type: application/json (got {got!r}).",
                           code="invalid_content_type")
    # Group by field: a union field fails once per member, which reads better as one line.
    by_param: dict[str | None, list[dict[str, Any]]] = {}
    for e in errors:
        by_param.setdefault(_param_of(tuple(e.get("loc", ()))), []).append(e)
    parts = []
    for param, errs in by_param.items():
        first = errs[0]
        if first.get("type") == "extra_forbidden":
            parts.append(f"'{param}' is not a recognized or supported request field")
        elif first.get("type") == "model_attributes_type" and param is None:
            parts.append("the request body must be a JSON object")
        elif len(errs) > 1:
            tags = [str(p) for e in errs for p in e.get("loc", ()) if _is_type_tag(p)]
            expected = f" (expected one of: {', '.join(dict.fromkeys(tags))})" if tags else ""
            parts.append(f"{param or 'body'}: invalid value{expected}")
        else:
            parts.append(f"{param or 'body'}: {first.get('msg')}")
    count = f"{len(parts)} validation error{'s' if len(parts) != 1 else ''}"
    first_param = next(iter(by_param), None)
    code = "unsupported_parameter" if errors and errors[0].get("type") == "extra_forbidden" else "invalid_value"
    return bad_request(f"{count}: " + "; ".join(parts), param=first_param, code=code)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc, request).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            err = APIError(404, f"Not found: {request.method} {request.url.path}", code="not_found")
        elif exc.status_code == 405:
            err = APIError(405, f"Method {request.method} is not allowed on {request.url.path}",
                           code="method_not_allowed")
        else:
            err = APIError(exc.status_code, str(exc.detail))
        resp = err.response()
        for k, v in (exc.headers or {}).items():
            resp.headers[k] = v
        return resp

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return internal(type(exc).__name__).response()
