"""The model loads on a thread of its own that ends with the load (server/api/app.py `in_own_thread`).

Why it matters: a thread that ran torch's parallel ops keeps its OpenMP team while it lives, and with more OpenMP
threads alive than cores libgomp sleeps at every barrier instead of spinning, which slows one stream's decoding
(bench/RESULTS.md#issue-5-cpu-scripted-decode). The speed is measured in bench/; here, that the loader thread
is gone afterwards.
"""
from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from server.scheduling.threads import in_own_thread


def test_the_load_runs_on_a_new_thread_that_is_gone_afterwards() -> None:
    seen: list[threading.Thread] = []

    def load() -> float:
        seen.append(threading.current_thread())
        a = torch.randn(256, 256)
        return float((a @ a).sum())  # a parallel op, as loading runs

    result = asyncio.run(in_own_thread(load))
    assert isinstance(result, float)
    assert seen[0] is not threading.main_thread() and seen[0].name == "model-loader"
    seen[0].join(5)
    assert not seen[0].is_alive()
    assert seen[0] not in threading.enumerate()


def test_a_failed_load_raises_in_the_awaiting_task() -> None:
    def load() -> None:
        raise FileNotFoundError("no such model")

    with pytest.raises(FileNotFoundError, match="no such model"):
        asyncio.run(in_own_thread(load))


def test_a_cancelled_load_waits_for_the_thread_and_discards_what_it_made() -> None:
    """A SIGTERM while loading cancels the awaiting task: the thread is waited for (a process that exits under its
    torch code aborts), and what it loaded goes to `discard` (the server stops the workers it started)."""
    release, discarded, seen = threading.Event(), [], []

    def load() -> str:
        seen.append(threading.current_thread())
        release.wait(5)
        return "state"

    async def main() -> None:
        task = asyncio.create_task(in_own_thread(load, discarded.append))
        while not seen:
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.sleep(0.1)
        assert not task.done()  # still waiting for the thread
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not seen[0].is_alive()

    asyncio.run(main())
    assert discarded == ["state"]
