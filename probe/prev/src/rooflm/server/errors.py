"""OpenAI-style errors: every failure the server answers has the body

    {"error": {"message": str, "type": str, "param": str | null, "code": str | int | null}}

FastAPI's default 422 for invalid bodies becomes a 400 naming the first offending field; unknown routes become 404
and methods 405 in the same shape; anything unexpected becomes a 500 in the same shape (and a bug to fix).
"""
from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class OpenAIError(Exception):
    """Raised by handlers; rendered by the exception handler below."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | int | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPE_BY_STATUS.get(status, "invalid_request_error")
        self.headers = headers


def error_body(message: str, type: str, param: str | None = None, code: str | int | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(err: OpenAIError) -> JSONResponse:
    return JSONResponse(error_body(err.message, err.type, err.param, err.code), status_code=err.status,
                        headers=err.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


_SAMPLING_FIELD = re.compile(r"SamplingParams\.(\w+)=")


def from_value_error(e: ValueError, default_param: str | None) -> OpenAIError:
    """A ValueError from SamplingParams or engine.add_request (messages name field and value) → 400."""
    message = str(e) or "invalid request"
    m = _SAMPLING_FIELD.search(message)
    param = m.group(1) if m else default_param
    return bad_request(message, param=param)


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# Errors that only say "the input is not of this union member's type". For a union-typed field (``stop``: a string
# or a list of strings) pydantic reports one error per member; the member whose type the input has reports the limit
# actually violated ("at most 16 items"), so that error is the one to show.
_TYPE_MISMATCH = frozenset({
    "string_type", "int_type", "float_type", "bool_type", "list_type", "dict_type", "model_type",
    "model_attributes_type", "none_required", "int_from_float", "string_sub_type",
})


def _pick_error(errors: list[dict[str, Any]]) -> dict[str, Any]:
    first = errors[0]
    field = [p for p in first.get("loc", ()) if p != "body"][:1]
    for e in errors:
        if [p for p in e.get("loc", ()) if p != "body"][:1] == field and e.get("type") not in _TYPE_MISMATCH:
            return e
    return first


def _describe_validation(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = list(exc.errors())
    if not errors:
        return "invalid request body", None
    first = _pick_error(errors)
    loc = [p for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('msg', '')}", None
    if not loc:  # the body itself has the wrong shape (not an object, missing)
        return f"the request body must be a JSON object: {first.get('msg', '')}", None
    param = str(loc[0])
    # Union members show up as type tags in loc ('list[int]'); keep field names and indices only.
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc
                   if isinstance(p, int) or re.fullmatch(r"[A-Za-z_]\w*", str(p)))
    if first.get("type") == "extra_forbidden":
        return (f"{path.lstrip('.')}: unknown field; it is not supported by this server (the accepted fields are "
                "listed in docs/serving.md)"), param
    msg = f"{path.lstrip('.')}: {first.get('msg', 'invalid value')}"
    if "input" in first and first.get("type") != "missing":
        msg += f" (got {_short(first['input'])})"
    return msg, param


def install_error_handlers(app: FastAPI, on_error: Any = None) -> None:
    """``on_error(request, status)`` is called for every error answered (the metrics count outcomes with it)."""

    def _note(request: Request, status: int) -> None:
        if on_error is not None:
            on_error(request, status)

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        _note(request, exc.status)
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _describe_validation(exc)
        _note(request, 400)
        return error_response(bad_request(message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        if status == 404:
            message = f"no route {request.method} {request.url.path}"
        elif status == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        _note(request, status)
        return error_response(OpenAIError(status, message, headers=getattr(exc, "headers", None)))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        _note(request, 500)
        return error_response(OpenAIError(500, f"internal error: {type(exc).__name__}"))
