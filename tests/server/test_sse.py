"""encode_events: what a stream yields, as the bytes on the wire, against sse-starlette's own encoder."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from sse_starlette.event import ServerSentEvent

from server.sse import encode_events

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
