"""`ResponseStore`: the stored responses of /v1/responses, in memory, bounded in count and in age.

A response is kept from the moment it is stored for at most `max_age` seconds, and the store holds at most
`max_items` of them: a new one past that evicts the oldest. Reading does not extend a response's life (OpenAI
keeps responses for a fixed time after their creation too). Only the event loop touches it: no lock (in the engine
process, which holds the store that several HTTP processes share, its pipes' threads take a lock).

The serving layer reads it through `StoredResponses` (awaited): this process's store (`LocalResponses`), or the
engine process's (server/process/client.py, `EngineResponses`) when several HTTP processes serve one engine.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class _Entry(Generic[T]):
    value: T
    stored_at: float


class ResponseStore(Generic[T]):
    """Values by id, oldest first; `max_items` 0 stores nothing."""

    def __init__(self, max_items: int, max_age: float, clock: Callable[[], float] = time.monotonic) -> None:
        if max_items < 0 or max_age <= 0:
            raise ValueError(f"max_items must be at least 0 and max_age positive, got {max_items}, {max_age}")
        self.max_items, self.max_age, self._clock = max_items, max_age, clock
        self._entries: OrderedDict[str, _Entry[T]] = OrderedDict()

    def put(self, key: str, value: T) -> None:
        """Store `value` under a new `key`, evicting the oldest entries past `max_items`."""
        self._expire()
        if self.max_items == 0:
            return
        self._entries.pop(key, None)
        self._entries[key] = _Entry(value, self._clock())
        while len(self._entries) > self.max_items:
            self._entries.popitem(last=False)

    def get(self, key: str) -> T | None:
        """The value stored under `key`, or None when there is none (never stored, deleted, evicted or expired)."""
        self._expire()
        entry = self._entries.get(key)
        return None if entry is None else entry.value

    def delete(self, key: str) -> bool:
        """Remove `key`; whether it was there."""
        self._expire()
        return self._entries.pop(key, None) is not None

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def _expire(self) -> None:
        # Entries are in the order they were stored, each stamped when stored: the expired ones are at the front.
        deadline = self._clock() - self.max_age
        while self._entries:
            key, entry = next(iter(self._entries.items()))
            if entry.stored_at > deadline:
                break
            del self._entries[key]


class StoredResponses(Protocol):
    """A response store as the serving layer uses it."""

    async def put(self, key: str, value: Any) -> None: ...

    async def get(self, key: str) -> Any | None: ...

    async def delete(self, key: str) -> bool: ...


class LocalResponses:
    """`StoredResponses` over a ResponseStore in this process."""

    def __init__(self, store: ResponseStore[Any]) -> None:
        self.store = store

    async def put(self, key: str, value: Any) -> None:
        self.store.put(key, value)

    async def get(self, key: str) -> Any | None:
        return self.store.get(key)

    async def delete(self, key: str) -> bool:
        return self.store.delete(key)
