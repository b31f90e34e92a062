"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}, for every failure."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("edge0.server")

_TYPES = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """The JSON body of an error response."""
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


class APIError(Exception):
    """Raised by handlers; turned into an OpenAI-shaped JSON error response."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def _validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """One message for pydantic's errors; `param` is the field they all concern, if any.

    A union field reports one error per member, so the messages are joined and the member
    names (the part of the locations that differs) are dropped from `param`.
    """
    if errors[0].get("type") == "json_invalid":
        return f"Request body is not valid JSON: {errors[0].get('ctx', {}).get('error', errors[0]['msg'])}", None
    locs = [[str(p) for p in e.get("loc", ()) if p != "body"] for e in errors]
    common = locs[0]
    for loc in locs[1:]:
        n = next((i for i, (a, b) in enumerate(zip(common, loc)) if a != b), min(len(common), len(loc)))
        common = common[:n]
    param = ".".join(common) or None
    msgs = list(dict.fromkeys(f"'{'.'.join(l)}': {e['msg']}" if l and not param else e["msg"]
                              for e, l in zip(errors, locs)))
    where = f"'{param}'" if param else "the request body"
    return f"Invalid value for {where}: {'; '.join(msgs[:4])}", param


def install_error_handlers(app: FastAPI) -> None:
    """Route validation errors (400, not FastAPI's 422), HTTP errors and crashes to OpenAI's shape."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        message, param = _validation_message(list(exc.errors()))
        return error_response(400, message, param, "invalid_value" if param else "invalid_request")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _crash(_: Request, exc: Exception):
        log.exception("request failed")
        return error_response(500, f"Internal error: {type(exc).__name__}: {exc}")
