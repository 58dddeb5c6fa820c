"""Per-request context: the request id (`X-Request-Id`), the record logged when the request ends, drain refusal.

`RequestContext` is the outermost middleware of the app (inside CORS). It keeps the request's `RequestRecord` in a
context variable, so that the serving layer fills in tokens, time to first token and finish reasons without
passing it around, and log lines written while the request runs carry its id.
"""
from __future__ import annotations

import logging
import re
import uuid

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.api.errors import answer
from server.api.state import app_state
from server.errors import APIError
from server.logs import RequestRecord, reset_current_request, set_current_request

access_log = logging.getLogger("emberserve.access")
REQUEST_ID_HEADER = "x-request-id"
# Probes and scrapes: never refused while draining, never counted in flight, logged only at debug level.
OPEN_PATHS = frozenset({"/health", "/livez", "/metrics"})
_CLIENT_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


def request_id_from(headers: Headers) -> str:
    """The client's X-Request-Id when it is a sane token, else a new one."""
    given = headers.get(REQUEST_ID_HEADER, "")
    return given if _CLIENT_ID.fullmatch(given) else uuid.uuid4().hex


async def send_error(scope: Scope, receive: Receive, send: Send, error: APIError) -> None:
    """Answer `error` from a middleware, counted like the app's own error responses."""
    await answer(scope["app"], error, scope["path"])(scope, receive, send)


class RequestContext:
    """Request id, in-flight count and request log for every HTTP request; refuses new work while draining."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = app_state(scope["app"])
        headers = Headers(scope=scope)
        length = headers.get("content-length")
        record = RequestRecord(request_id_from(headers), scope["method"], scope["path"],
                               body_bytes=int(length) if length is not None and length.isdigit() else None)
        token = set_current_request(record)
        probe = scope["path"] in OPEN_PATHS

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = record.id
            await send(message)

        if not probe:
            state.in_flight += 1
        try:
            if state.draining and not probe:
                await send_error(scope, receive, send_with_id, APIError(
                    503, "the server is shutting down; retry on another replica", code="shutting_down",
                    headers={"Connection": "close"}))
            else:
                await self.app(scope, receive, send_with_id)
        except Exception:
            if record.status is None:  # the app's last-resort handler answers 500 outside this middleware
                record.status = 500
            raise
        finally:
            if not probe:
                state.in_flight -= 1
            level = logging.DEBUG if probe else logging.INFO
            if access_log.isEnabledFor(level):  # the record's fields are built only for a line that is written
                access_log.log(level, "%s %s %s", record.method, record.path, record.status,
                               extra={"request": record.fields()})
            reset_current_request(token)
