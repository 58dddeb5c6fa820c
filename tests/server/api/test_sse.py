"""encode_events: what a stream yields, as the bytes on the wire, against sse-starlette's own encoder; the stream
response over a fake ASGI connection: order and end, a client that leaves, a stalled send, pings, a failing
producer, a cancellation from outside."""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st
from sse_starlette.event import ServerSentEvent

from server.api import sse
from server.api.sse import DONE, encode_events, sse_response

payloads = st.text(st.characters(codec="utf-8"), max_size=40)
names = st.text(st.characters(codec="utf-8", exclude_characters="\r\n"), min_size=1, max_size=12)


@given(payloads)
def test_a_data_payload_is_what_sse_starlette_writes(data: str) -> None:
    assert encode_events(data) == ServerSentEvent(data, sep="\n").encode()


@given(names, payloads)
def test_a_named_event_is_what_sse_starlette_writes(kind: str, data: str) -> None:
    assert encode_events({"event": kind, "data": data}) == ServerSentEvent(data, event=kind, sep="\n").encode()


@given(st.lists(st.one_of(payloads, st.builds(lambda k, d: {"event": k, "data": d}, names, payloads)), max_size=5))
def test_a_list_is_its_events_in_order_in_one_write(items: list) -> None:
    assert encode_events(items) == b"".join(encode_events(item) for item in items)


# ---- the stream response over a fake ASGI connection ----

class Connection:
    """uvicorn's side of one response: what was sent, a disconnect to deliver, a send that can be held."""

    def __init__(self) -> None:
        self.sent: list[dict] = []
        self.disconnect = asyncio.Event()
        self.release = asyncio.Event()
        self.release.set()
        self.failures: list[str] = []
        self.sending, self.end_overlapped = 0, False
        self.scope = {"type": "http", "method": "POST", "path": "/v1/completions",
                      "app": SimpleNamespace(state=SimpleNamespace(server=SimpleNamespace(
                          metrics=SimpleNamespace(fail=self.failures.append))))}

    async def receive(self) -> dict:
        await self.disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        if message.get("more_body") is False and self.sending:
            self.end_overlapped = True  # uvicorn would refuse a message after this one
        self.sending += 1
        try:
            await self.release.wait()
            self.sent.append(message)
        finally:
            self.sending -= 1

    def bodies(self) -> list[bytes]:
        return [m["body"] for m in self.sent if m["type"] == "http.response.body"]


class Producer:
    """An event iterator that yields what it is given and records how it ended."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.closed = False

    async def events(self) -> AsyncIterator[str]:
        try:
            while (item := await self.queue.get()) is not None:
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            self.closed = True


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 10))


def _respond(conn: Connection, producer: Producer, closes: list[int], stall: float | None = None) -> asyncio.Task:
    response = sse_response(producer.events(), on_close=lambda: closes.append(1), send_timeout=stall)
    return asyncio.get_running_loop().create_task(response(conn.scope, conn.receive, conn.send))


def test_events_go_out_in_order_then_the_end_and_on_close_runs_once() -> None:
    async def scenario() -> None:
        conn, producer, closes = Connection(), Producer(), []
        task = _respond(conn, producer, closes)
        for item in ("a", ["b", "c"], DONE, None):
            producer.queue.put_nowait(item)
        await task
        assert conn.sent[0]["type"] == "http.response.start" and conn.sent[0]["status"] == 200
        assert (b"content-type", b"text/event-stream; charset=utf-8") in conn.sent[0]["headers"]
        assert conn.bodies() == [b"data: a\n\n", b"data: b\n\ndata: c\n\n", b"data: [DONE]\n\n", b""]
        assert conn.sent[-1]["more_body"] is False and closes == [1] and producer.closed

    run(scenario)


def test_a_client_that_leaves_while_nothing_is_due_closes_the_producer_at_once() -> None:
    async def scenario() -> None:
        conn, producer, closes = Connection(), Producer(), []
        task = _respond(conn, producer, closes)
        producer.queue.put_nowait("first")
        while len(conn.bodies()) < 1:
            await asyncio.sleep(0.001)
        conn.disconnect.set()  # the producer waits for its next event
        await task  # ends without raising: the response had started
        assert producer.closed and closes == [1] and conn.bodies() == [b"data: first\n\n"]

    run(scenario)


def test_a_send_held_past_the_stall_timeout_cuts_the_stream() -> None:
    async def scenario() -> None:
        conn, producer, closes = Connection(), Producer(), []
        task = _respond(conn, producer, closes, stall=0.2)
        producer.queue.put_nowait("a")
        while len(conn.bodies()) < 1:
            await asyncio.sleep(0.001)
        conn.release.clear()  # the client stops reading
        producer.queue.put_nowait("b")
        started = time.monotonic()
        await task
        assert 0.2 <= time.monotonic() - started < 2 and producer.closed and closes == [1]
        assert conn.bodies() == [b"data: a\n\n"]

    run(scenario)


def test_an_idle_stream_gets_a_ping_comment_and_still_ends_last(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sse, "PING_SECONDS", 0.05)
    monkeypatch.setattr(sse, "TICK_SECONDS", 0.01)

    async def scenario() -> None:
        conn, producer, closes = Connection(), Producer(), []
        task = _respond(conn, producer, closes)
        while b": ping\n\n" not in conn.bodies():
            await asyncio.sleep(0.01)
        conn.release.clear()  # a ping on its way when the stream ends
        await asyncio.sleep(0.1)
        producer.queue.put_nowait(None)
        await asyncio.sleep(0.05)
        conn.release.set()
        await task
        bodies = conn.bodies()
        assert bodies[-1] == b"" and all(b == b": ping\n\n" for b in bodies[:-1]) and closes == [1]
        assert not conn.end_overlapped

    run(scenario)


def test_a_producer_that_fails_ends_the_stream_with_an_error_event_and_done() -> None:
    async def scenario() -> None:
        conn, producer, closes = Connection(), Producer(), []
        task = _respond(conn, producer, closes)
        producer.queue.put_nowait("a")
        producer.queue.put_nowait(RuntimeError("boom-internal"))
        await task
        error, done = conn.bodies()[1].split(b"\n\n")[:2]
        assert json.loads(error.removeprefix(b"data: "))["error"]["type"] == "server_error"
        assert b"boom" not in conn.bodies()[1] and done == b"data: [DONE]" and conn.bodies()[-1] == b""
        assert conn.failures == ["server_error"] and closes == [1]

    run(scenario)


def test_a_cancellation_from_outside_goes_on_and_still_closes() -> None:
    async def scenario() -> None:
        conn, producer, closes = Connection(), Producer(), []
        task = _respond(conn, producer, closes)
        await asyncio.sleep(0.01)
        task.cancel()  # uvicorn's, at shutdown
        with pytest.raises(asyncio.CancelledError):
            await task
        assert producer.closed and closes == [1]

    run(scenario)
