"""Errors in each API's own shape, for every failure.

OpenAI (Chat Completions, Completions, Responses, everything else):
`{"error": {"message", "type", "param", "code"}}`. Anthropic (`/v1/messages...`):
`{"type": "error", "error": {"type", "message"}}`. The path of the request decides.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("edge0.server")

ANTHROPIC_PREFIX = "/v1/messages"
_OPENAI_TYPES = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}
_ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


class APIError(Exception):
    """Raised by handlers; turned into an error response in the API's shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        # A message may quote the request (a model or tool name), which JSON may carry as a lone
        # surrogate that UTF-8 cannot encode: it is shown escaped (\\udc80) instead of failing the answer.
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def is_anthropic(path: str) -> bool:
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


def openai_error(error: APIError) -> dict:
    kind = _OPENAI_TYPES.get(error.status, "server_error" if error.status >= 500 else "invalid_request_error")
    return {"error": {"message": error.message, "type": kind, "param": error.param, "code": error.code}}


def anthropic_error(error: APIError) -> dict:
    kind = _ANTHROPIC_TYPES.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def error_response(path: str, error: APIError, headers: dict | None = None) -> JSONResponse:
    """`error` as a JSON response in the shape of the API that `path` belongs to."""
    body = anthropic_error(error) if is_anthropic(path) else openai_error(error)
    return JSONResponse(body, status_code=error.status, headers=headers)


# pydantic's names for the members of a union in an error's location (not fields of the request)
_MEMBERS = {"str", "constrained-str", "int", "float", "bool", "list", "dict", "none"}


def _member(part) -> bool:
    """A union member's name or a tagged union's tag ("type=..."), not a field of the request."""
    return isinstance(part, str) and (part in _MEMBERS or "[" in part or "=" in part)


def _fields(loc: tuple, body) -> list[str]:
    """The request's field names along pydantic's `loc`: member names and the tags of tagged
    unions dropped (a tag is the `type` of the object it stands in, where no field has its name)."""
    out, value = [], body
    for part in loc:
        if part == "body" and not out:
            continue
        is_tag = isinstance(value, dict) and part not in value and value.get("type") == part
        if is_tag or _member(part):
            continue
        out.append(str(part))
        try:
            value = value[part]
        except (KeyError, IndexError, TypeError):
            value = None
    return out


def _validation_message(errors: list[dict], body=None) -> tuple[str, str | None]:
    """One message for pydantic's errors on `body`; `param` is the field they all concern, if any.

    A union field reports one error per member: the members that got furthest into the value
    name the field, and pydantic's member names and tags are dropped from it.
    """
    if errors[0].get("type") == "json_invalid":
        return f"Request body is not valid JSON: {errors[0].get('ctx', {}).get('error', errors[0]['msg'])}", None
    # a union's members fail at different depths ("input": not a string; "input.0": not an item):
    # for each field, the member that got furthest names it
    deepest: dict = {}
    for e in errors:
        field = e.get("loc", ("",))[:2]
        deepest[field] = max(deepest.get(field, 0), len(e.get("loc", ())))
    errors = [e for e in errors if len(e.get("loc", ())) == deepest[e.get("loc", ("",))[:2]]]
    locs = [_fields(tuple(e.get("loc", ())), body) for e in errors]
    common = locs[0]
    for loc in locs[1:]:
        n = next((i for i, (a, b) in enumerate(zip(common, loc)) if a != b), min(len(common), len(loc)))
        common = common[:n]
    param = ".".join(common) or None
    # each message with the part of its field below `param` (all of it when there is none)
    msgs = list(
        dict.fromkeys(
            f"'{'.'.join(l[len(common) :])}': {e['msg']}" if l[len(common) :] else e["msg"]
            for e, l in zip(errors, locs)
        )
    )
    where = f"'{param}'" if param else "the request body"
    return f"Invalid value for {where}: {'; '.join(msgs[:4])}", param


def install_error_handlers(app: FastAPI) -> None:
    """Route validation errors (400, not FastAPI's 422), HTTP errors and crashes to the API's shape."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(request.url.path, exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        message, param = _validation_message(list(exc.errors()), exc.body)
        return error_response(
            request.url.path, APIError(400, message, param, "invalid_value" if param else "invalid_request")
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return error_response(
            request.url.path, APIError(exc.status_code, str(exc.detail)), headers=getattr(exc, "headers", None)
        )

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception):
        log.exception("request failed")
        return error_response(request.url.path, APIError(500, f"Internal error: {type(exc).__name__}: {exc}"))
