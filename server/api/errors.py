"""The handlers that turn every failure into the error envelope of its API (OpenAI's, or Anthropic's under
/v1/messages); tracebacks go to the log, never to the client."""
from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.api.metrics import ServerMetrics
from server.errors import APIError, internal_error, invalid, speaks_anthropic

log = logging.getLogger("emberserve")


def error_response(error: APIError, path: str = "") -> JSONResponse:
    """The error's JSON response, in the envelope of the API that `path` belongs to."""
    body = error.anthropic_body() if speaks_anthropic(path) else error.body()
    return JSONResponse(body, status_code=error.status, headers=error.headers)


# A union member's label names a validator wrapped around a type, as in `function-after[_check(), str]`: say `str`.
_VALIDATOR_LABEL = re.compile(r"function-\w+\[\w+\(\), (\w+)\]")


def _param_from_loc(loc: tuple[Any, ...]) -> str | None:
    parts = [_VALIDATOR_LABEL.sub(r"\1", str(p)) for p in loc if p not in ("body", "query", "path")]
    return ".".join(parts) or None


def error_param(errors: list[dict[str, Any]]) -> str | None:
    """The field at fault: none for unparsable JSON; for a union's per-member errors, the field they share."""
    if not errors or errors[0].get("type") == "json_invalid":
        return None
    locs = [tuple(e.get("loc", ())) for e in errors]
    common = locs[0]
    for loc in locs[1:]:
        n = 0
        while n < min(len(common), len(loc)) and common[n] == loc[n]:
            n += 1
        common = common[:n]
    return _param_from_loc(common) or _param_from_loc(locs[0])


def _where(err: dict[str, Any], body: Any) -> str:
    """' at line L, column C' of a JSON syntax error (FastAPI gives the character offset and the document)."""
    loc = tuple(err.get("loc", ()))
    if len(loc) != 2 or not isinstance(loc[1], int) or not isinstance(body, str):
        return ""
    offset = loc[1]
    line = body.count("\n", 0, offset) + 1
    column = offset - (body.rfind("\n", 0, offset) + 1) + 1
    return f" at line {line}, column {column} (character {offset})"


def _validation_message(err: dict[str, Any], body: Any = None) -> str:
    param = _param_from_loc(tuple(err.get("loc", ())))
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    if err.get("type") == "json_invalid":
        return f"request body is not valid JSON: {err.get('ctx', {}).get('error', msg)}{_where(err, body)}"
    if tuple(err.get("loc", ())) == ("body",):  # no body, or JSON that is not an object
        return "request body is empty: expected a JSON object" if err.get("type") == "missing" else \
            f"request body must be a JSON object: {msg}"
    return f"{param}: {msg}" if param else msg


def _unparsable_body(exc: StarletteHTTPException) -> str:
    """Why FastAPI could not read the body as JSON, from the exception it chained (JSON syntax errors come apart)."""
    cause = exc.__cause__
    if isinstance(cause, UnicodeDecodeError):
        return f"request body is not valid UTF-8: {cause.reason} at byte {cause.start}"
    if isinstance(cause, RecursionError):
        # The parser recurses once per level and stops at the interpreter's recursion limit, before reading on.
        return "request body nests JSON arrays or objects too deeply: the limit is about 1,000 levels"
    return str(exc.detail)


def metrics_of(app: FastAPI) -> ServerMetrics:
    """The app's metrics: its `AppState`'s (server/api/state.py, which this module cannot import: the serving
    classes it types import this one)."""
    metrics: ServerMetrics = app.state.server.metrics
    return metrics


def count(app: FastAPI, error: APIError) -> None:
    """Count an error response in the app's metrics by its type."""
    if error.status != 499:  # the client went away: nobody reads this, and its sequences count as aborted
        metrics_of(app).fail(error.type)


def answer(app: FastAPI, error: APIError, path: str = "") -> JSONResponse:
    """The error's response to a request for `path`, counted in the app's metrics."""
    count(app, error)
    return error_response(error, path)


def install_error_handlers(app: FastAPI) -> None:
    """Every error path answers the envelope of its API; tracebacks go to the log, never to the client."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return answer(request.app, exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        message = "; ".join(_validation_message(e, exc.body) for e in errors[:5]) or "invalid request"
        return answer(request.app, invalid(message, param=error_param(errors)), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code in (404, 405):
            what = "not found" if exc.status_code == 404 else "method not allowed"
            message = f"{request.method} {request.url.path}: {what}"
        else:
            message = _unparsable_body(exc) if exc.status_code == 400 else str(exc.detail)
        return answer(request.app, APIError(exc.status_code, message, headers=getattr(exc, "headers", None)),
                      request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return answer(request.app, internal_error(), request.url.path)
