"""Server-sent events as the OpenAI client reads them: `data: <json>` events, then `data: [DONE]`."""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from sse_starlette.event import ServerSentEvent
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from server.api.errors import count
from server.errors import APIError, internal_error

log = logging.getLogger("emberserve.serving")
DONE = "[DONE]"
PING_SECONDS = 15  # keep-alive comments for proxies; the client ignores lines starting with ':'
TICK_SECONDS = 1.0  # how often a stream looks for a stalled send or a due ping (at most)


class _EventStream(StreamingResponse):
    """An event stream that ends well however it ends, with one helper task a stream.

    - `on_close` runs whatever ends the response: finished, failed, cut for a slow client, left by the client, or
      cancelled before the event iterator ever ran (when the iterator's own cleanup never runs).
    - A client that goes away is noticed at once, also while no event is due (a task waits for uvicorn's
      `http.disconnect`): the stream's task is cancelled, which closes the iterator and so cancels its generations.
    - An unexpected failure of the producer ends the stream with an error event and [DONE]: the 200 and the first
      events are sent by then, so the exception handlers cannot answer for it, and without this the connection
      would just drop (a truncated stream instead of an error).
    - A send that waits longer than `stall_timeout` seconds (a client that stopped reading) cuts the stream.
    - After PING_SECONDS with nothing sent, a comment line keeps proxies from closing an idle connection.

    Not sse-starlette's EventSourceResponse, which runs four tasks in an anyio task group for every stream (the
    events, pings, uvicorn's exit signal, the disconnect): their start and cancellation were a good part of the
    HTTP process's CPU per streamed request (bench/http_cost.py; bench/RESULTS.md#issue-13-http-cost-stream-task).
    uvicorn's own shutdown (timeout_graceful_shutdown, server/launch/cli.py) ends streams left open when the server stops.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[Any], on_close: Callable[[], None], stall_timeout: float | None) -> None:
        super().__init__(events, headers={"Cache-Control": "no-cache", "Connection": "keep-alive",
                                          "X-Accel-Buffering": "no"})
        self._on_close, self._stall_timeout = on_close, stall_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        sending_since: float | None = None  # when the send under way began
        last_sent = loop.time()
        ended = gone = cut = False
        ping: asyncio.Task[None] | None = None

        async def timed_send(message: Message) -> None:
            nonlocal sending_since, last_sent
            sending_since = loop.time()
            try:
                await send(message)
            finally:
                sending_since, last_sent = None, loop.time()

        async def listen() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            if not ended:
                gone = True
                task.cancel()

        async def send_ping() -> None:
            if not ended and sending_since is None:
                await timed_send({"type": "http.response.body", "body": b": ping\n\n", "more_body": True})

        def tick() -> None:  # once a second: a stalled send, an idle stream
            nonlocal cut, ping, timer
            now = loop.time()
            if ended:
                return
            if sending_since is not None and self._stall_timeout is not None \
                    and now - sending_since > self._stall_timeout:
                cut = True
                task.cancel()
                return
            if sending_since is None and now - last_sent >= PING_SECONDS and (ping is None or ping.done()):
                ping = loop.create_task(send_ping())
            timer = loop.call_later(every, tick)

        every = TICK_SECONDS if self._stall_timeout is None else min(TICK_SECONDS, self._stall_timeout / 4)
        listener = loop.create_task(listen())
        timer = loop.call_later(every, tick)
        try:
            await timed_send({"type": "http.response.start", "status": self.status_code,
                              "headers": self.raw_headers})
            async with aclosing(_guarded(self.body_iterator, scope)) as chunks:  # closed at once however it ends
                async for chunk in chunks:
                    await timed_send({"type": "http.response.body", "body": chunk, "more_body": True})
            if ping is not None and not ping.done():
                await ping  # the last message must be the last sent
            ended = True
            await timed_send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            # Our own cancellations, handled: the response has started, so just close. Any other (uvicorn's at
            # shutdown) goes on.
            if not (cut or gone) or task.uncancel() > 0:
                raise
            if cut:
                log.info("the client stopped reading for %.0f s: stream cut", self._stall_timeout)
        finally:
            ended = True
            timer.cancel()
            listener.cancel()
            if ping is not None:
                ping.cancel()
            self._on_close()
        if self.background is not None:
            await self.background()


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
    the rest of a chunk's way out (bench/RESULTS.md#issue-13-http-cost-host-side); payloads with a line break still go
    through it.
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
                 send_timeout: float | None = None) -> StreamingResponse:
    """Stream each yielded string as one `data:` event; `on_close()` runs when the response ends, whatever ends it.

    A send that waits longer than `send_timeout` seconds (a client that stopped reading) cuts the stream.
    """
    return _EventStream(events, on_close, send_timeout)


def event_json(body: dict[str, Any]) -> str:
    """One event's compact JSON payload."""
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"))


def sse_error(error: APIError) -> str:
    """A failure after the stream started, as the event the client raises on."""
    return event_json(error.body())
