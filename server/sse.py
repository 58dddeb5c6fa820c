"""Server-sent events as the OpenAI client reads them: `data: <json>` events, then `data: [DONE]`."""
from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from sse_starlette.sse import EventSourceResponse, SendTimeoutError
from starlette.types import Receive, Scope, Send

from .errors import APIError, count, internal_error

log = logging.getLogger("emberserve.serving")
DONE = "[DONE]"
PING_SECONDS = 15  # keep-alive comments for proxies; the client ignores lines starting with ':'


class _EventStream(EventSourceResponse):
    """An event stream that ends well however it ends.

    - `on_close` runs whatever ends the response: finished, failed, cut for a slow client, or cancelled by a
      disconnect before the event iterator ever ran (when the iterator's own cleanup never runs).
    - An unexpected failure of the producer ends the stream with an error event and [DONE]: the 200 and the first
      events are sent by then, so the exception handlers cannot answer for it, and without this the connection
      would just drop (a truncated stream instead of an error).
    - A send that waits longer than `send_timeout` (a client that stopped reading) cuts the stream.
    """

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(events, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.body_iterator = _guarded(self.body_iterator, scope)
        try:
            await super().__call__(scope, receive, send)
        except SendTimeoutError:  # the response has started: all there is to do is close the connection
            log.info("the client stopped reading for %.0f s: stream cut", self.send_timeout)
        finally:
            self._on_close()


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
