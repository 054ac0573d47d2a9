"""Errors in OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}}.

Bad input is always a 4xx that names what was wrong; a 5xx means a bug in the server or a
dead engine, never a bad request.
"""
from __future__ import annotations

import re

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
         405: "invalid_request_error", 413: "invalid_request_error", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    @classmethod
    def bad_request(cls, error: Exception, default_param: str | None = None) -> "APIError":
        """A ValueError from SamplingParams or the engine; their messages start with `name=` or `name:`."""
        message = str(error)
        named = re.match(r"(\w+)[=:]", message)
        return cls(400, message, param=named.group(1) if named else default_param)

    def response(self, headers: dict | None = None) -> JSONResponse:
        return JSONResponse(error_body(self.status, self.message, self.param, self.code), self.status, headers=headers)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": TYPES.get(status, "server_error"), "param": param, "code": code}}


def validation_error(exc: RequestValidationError) -> APIError:
    """pydantic's complaint about a request body, as a 400 that names the first bad field."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return APIError(400, f"request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}")
    loc = [str(part) for part in first.get("loc", ()) if part != "body" and not _is_union_tag(part)]
    param = loc[0] if loc else None
    where = ".".join(loc) or "request body"
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return APIError(400, f"{where}: {first['msg']}{_received(first)}{more}", param=param)


def _received(error: dict) -> str:
    """The value a field received, when it is short enough to quote (a huge one is its own problem)."""
    value = error.get("input")
    if isinstance(value, (dict, list)) or value is None:
        return ""
    text = repr(value)
    return f", got {text}" if len(text) <= 60 else f", got a {type(value).__name__} of {len(text)} characters"


def _is_union_tag(part) -> bool:
    """pydantic names the member of a union it tried ('str', 'list[int]', 'function-after[...]')."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "list", "dict"))
