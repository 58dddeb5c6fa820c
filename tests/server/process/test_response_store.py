"""The stored responses' bounds: at most `max_items` (the oldest goes first), none older than `max_age` seconds."""
from __future__ import annotations

import pytest

from server.process.response_store import ResponseStore


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_past_max_items_the_oldest_go_first() -> None:
    store: ResponseStore[int] = ResponseStore(max_items=3, max_age=60, clock=Clock())
    for i in range(5):
        store.put(f"r{i}", i)
    assert len(store) == 3
    assert [store.get(f"r{i}") for i in range(5)] == [None, None, 2, 3, 4]


def test_reading_does_not_keep_an_entry_longer() -> None:
    store: ResponseStore[str] = ResponseStore(max_items=2, max_age=60, clock=Clock())
    store.put("a", "A")
    store.put("b", "B")
    assert store.get("a") == "A"  # read, yet still the oldest
    store.put("c", "C")
    assert (store.get("a"), store.get("b"), store.get("c")) == (None, "B", "C")


def test_entries_expire_max_age_after_they_were_stored() -> None:
    clock = Clock()
    store: ResponseStore[str] = ResponseStore(max_items=10, max_age=30, clock=clock)
    store.put("old", "x")
    clock.now += 20
    store.put("new", "y")
    clock.now += 9.9  # old: 29.9 s
    assert store.get("old") == "x"
    clock.now += 0.1  # old: 30 s, new: 10 s
    assert store.get("old") is None and store.get("new") == "y"
    clock.now += 20  # new: 30 s
    assert store.get("new") is None and len(store) == 0


def test_delete_says_whether_it_was_there() -> None:
    store: ResponseStore[int] = ResponseStore(max_items=4, max_age=60, clock=Clock())
    store.put("a", 1)
    assert store.delete("a") is True
    assert store.delete("a") is False and store.get("a") is None


def test_size_zero_keeps_nothing_and_bad_bounds_are_refused() -> None:
    store: ResponseStore[int] = ResponseStore(max_items=0, max_age=60)
    store.put("a", 1)
    assert store.get("a") is None and len(store) == 0
    with pytest.raises(ValueError):
        ResponseStore(max_items=-1, max_age=60)
    with pytest.raises(ValueError):
        ResponseStore(max_items=1, max_age=0)
