"""Server-sent events as the OpenAI client reads them: `data: <json>` events, then `data: [DONE]`."""
from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from sse_starlette.sse import EventSourceResponse
from starlette.types import Receive, Scope, Send

from .errors import APIError, count, internal_error

log = logging.getLogger("emberserve")
DONE = "[DONE]"
PING_SECONDS = 15  # keep-alive comments for proxies; the client ignores lines starting with ':'


class _EventStream(EventSourceResponse):
    """An event stream that an unexpected failure of its producer ends with an error event and [DONE].

    The 200 and the first events are sent by then, so the exception handlers cannot answer for it: without this
    the connection would just drop, and the client would see a truncated stream instead of an error.
    """

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.body_iterator = _guarded(self.body_iterator, scope)
        await super().__call__(scope, receive, send)


async def _guarded(events: AsyncIterator[str], scope: Scope) -> AsyncIterator[str]:
    async with aclosing(events):  # closed with the stream, so that its generations are cancelled at once
        try:
            async for event in events:
                yield event
        except Exception:
            log.exception("unhandled error while streaming %s %s", scope["method"], scope["path"])
            error = internal_error()
            count(scope["app"], error)
            yield sse_error(error)
            yield DONE


def sse_response(events: AsyncIterator[str]) -> EventSourceResponse:
    """Stream each yielded string as one `data:` event; a client that disconnects cancels the iterator."""
    return _EventStream(events, sep="\n", ping=PING_SECONDS, headers={"Cache-Control": "no-cache"})


def event_json(body: dict[str, Any]) -> str:
    """One event's compact JSON payload."""
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"))


def sse_error(error: APIError) -> str:
    """A failure after the stream started, as the event the client raises on."""
    return event_json(error.body())
