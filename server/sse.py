"""Server-sent events as the OpenAI client reads them: `data: <json>` events, then `data: [DONE]`."""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from sse_starlette.event import ServerSentEvent
from sse_starlette.sse import EventSourceResponse
from starlette.types import Message, Receive, Scope, Send

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
    - A send that waits longer than `stall_timeout` seconds (a client that stopped reading) cuts the stream.
    """

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None], stall_timeout: float | None,
                 **kwargs: Any) -> None:
        super().__init__(events, **kwargs)
        self._on_close, self._stall_timeout = on_close, stall_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.body_iterator = _guarded(self.body_iterator, scope)
        loop = asyncio.get_running_loop()
        stalled_since: float | None = None  # when the send under way began
        cut = False

        async def timed_send(message: Message) -> None:
            nonlocal stalled_since
            stalled_since = loop.time()
            try:
                await send(message)
            finally:
                stalled_since = None

        async def watchdog(task: asyncio.Task, timeout: float) -> None:
            # One timer a stream rather than sse-starlette's cancel scope around every send: at a few hundred
            # streams that scope was a seventh of the event loop's time.
            nonlocal cut
            while True:
                await asyncio.sleep(min(1.0, timeout / 4))
                if stalled_since is not None and loop.time() - stalled_since > timeout:
                    cut = True
                    task.cancel()
                    return

        task = asyncio.current_task()
        guard = None
        if self._stall_timeout is not None and task is not None:
            guard = asyncio.create_task(watchdog(task, self._stall_timeout))
        try:
            await super().__call__(scope, receive, timed_send)
        except asyncio.CancelledError:
            if not cut:
                raise
            task.uncancel()  # our own cancellation, handled: the response has started, so just close
            log.info("the client stopped reading for %.0f s: stream cut", self._stall_timeout)
        finally:
            if guard is not None:
                guard.cancel()
            self._on_close()

    async def _send_with_timeout(self, send: Send, message: Message) -> None:
        # sse-starlette wraps every send in a cancel scope for its own send timeout, which this class does not use
        # (the watchdog above times sends instead): the scope cost more than the send itself at a chunk a token.
        await send(message)


async def _guarded(events: AsyncIterator[Any], scope: Scope) -> AsyncIterator[bytes]:
    async with aclosing(events):  # closed with the stream, so that its generations are cancelled at once
        try:
            async for event in events:
                yield encode_events(event)
        except Exception:
            log.exception("unhandled error while streaming %s %s", scope["method"], scope["path"])
            error = internal_error()
            count(scope["app"], error)
            yield encode_events([sse_error(error), DONE])


def encode_events(item: str | dict[str, str] | list[str | dict[str, str]]) -> bytes:
    """What a stream yields, as the bytes on the wire: a `data:` payload (str), a named event ({"event", "data"}),
    or a list of them, written together (one send for what a reader that fell behind has waiting).

    Encoded here rather than by sse-starlette, whose general encoder (line splitting, every field) cost more than
    the rest of a chunk's way out (bench/RESULTS.md, issue 13); payloads with a line break still go through it.
    """
    if isinstance(item, list):
        return b"".join(map(encode_events, item))
    if isinstance(item, str):
        if "\n" in item or "\r" in item:
            return ServerSentEvent(item, sep="\n").encode()
        return b"data: " + item.encode() + b"\n\n"
    kind, data = item["event"], item["data"]
    if "\n" in data or "\r" in data or "\n" in kind or "\r" in kind:
        return ServerSentEvent(data, event=kind, sep="\n").encode()
    return b"event: " + kind.encode() + b"\ndata: " + data.encode() + b"\n\n"


def sse_response(events: AsyncIterator[Any], on_close: Callable[[], None],
                 send_timeout: float | None = None) -> EventSourceResponse:
    """Stream each yielded string as one `data:` event; `on_close()` runs when the response ends, whatever ends it.

    A send that waits longer than `send_timeout` seconds (a client that stopped reading) cuts the stream.
    """
    return _EventStream(events, on_close, send_timeout, sep="\n", ping=PING_SECONDS,
                        headers={"Cache-Control": "no-cache"})


def event_json(body: dict[str, Any]) -> str:
    """One event's compact JSON payload."""
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"))


def sse_error(error: APIError) -> str:
    """A failure after the stream started, as the event the client raises on."""
    return event_json(error.body())
