"""Server-sent events as the OpenAI client reads them: `data: <json>` events, then `data: [DONE]`."""
from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from sse_starlette.sse import EventSourceResponse, SendTimeoutError
from starlette.types import Receive, Scope, Send

from .errors import APIError

log = logging.getLogger("emberserve.serving")
DONE = "[DONE]"
PING_SECONDS = 15  # keep-alive comments for proxies; the client ignores lines starting with ':'


class _EventStream(EventSourceResponse):
    """An EventSourceResponse that calls `on_close` however the response ends: finished, failed, cut for a slow
    client, or cancelled by a disconnect before the event iterator ever ran (when its own cleanup never runs)."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(events, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except SendTimeoutError:  # the response has started: all there is to do is close the connection
            log.info("the client stopped reading for %.0f s: stream cut", self.send_timeout)
        finally:
            self._on_close()


def sse_response(events: AsyncIterator[str], on_close: Callable[[], None],
                 send_timeout: float | None = None) -> EventSourceResponse:
    """Stream each yielded string as one `data:` event; `on_close()` runs when the response ends, whatever ends it.

    A send that waits longer than `send_timeout` seconds (a client that stopped reading) cuts the stream.
    """
    return _EventStream(events, on_close, sep="\n", ping=PING_SECONDS, send_timeout=send_timeout,
                        headers={"Cache-Control": "no-cache"})


def event_json(body: dict[str, Any]) -> str:
    """One event's compact JSON payload."""
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"))


def sse_error(error: APIError) -> str:
    """A failure after the stream started, as the event the client raises on."""
    return event_json(error.body())
