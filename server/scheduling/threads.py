"""Process-wide thread and memory set-up: the GIL's switch interval, glibc's malloc arenas, and a loader thread
that ends with its work."""
from __future__ import annotations

import asyncio
import ctypes
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


# How long a thread may hold the GIL while another waits for it (Python's default: 5 ms). The worker thread
# needs the GIL back after every GPU call, and the event loop, busy with a few hundred streams, would keep it for
# the whole default interval each time: the GPU then idles for most of each step.
GIL_SWITCH_INTERVAL_S = 0.0005


async def in_own_thread(fn: Callable[[], T], discard: Callable[[T], None] | None = None,
                         interrupt: Callable[[], None] | None = None) -> T:
    """fn() on a new thread that ends with it; cancelled, calls `interrupt` (what makes fn return sooner), waits for
    fn to return and hands what it made to `discard` (a loaded model's started workers, to stop).

    Loading runs torch's parallel ops, and each thread that does gets its own OpenMP team, kept while the thread
    lives. With more OpenMP threads alive than cores, libgomp stops spinning at its barriers and sleeps instead, so
    every parallel region of the workers then waits on a futex wake-up: one stream decoded far slower with the loader
    in an executor thread (asyncio.to_thread), which never ends (bench/RESULTS.md#issue-5-cpu-scripted-decode).
    Torch's code cannot be interrupted, and a process that exits while the thread is inside it aborts
    (std::terminate: "terminate called without an active exception", exit 134), so a cancellation (SIGTERM while
    loading) waits for the thread.
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if done.cancelled():
            if error is None and discard is not None:
                discard(result)
            return
        if error is None:
            done.set_result(result)
        else:
            done.set_exception(error)

    def run() -> None:
        try:
            result = fn()
        except BaseException as e:  # handed to the awaiting task
            loop.call_soon_threadsafe(settle, None, e)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    thread = threading.Thread(target=run, name="model-loader", daemon=True)
    thread.start()
    try:
        return await done
    except asyncio.CancelledError:
        if interrupt is not None:
            interrupt()
        while thread.is_alive():
            await asyncio.sleep(0.05)
        await asyncio.sleep(0)  # settle, called from the thread's last act, runs before this returns
        raise


def cap_malloc_arenas(arenas: int = 2) -> bool:
    """Cap glibc's malloc arenas (one per thread by default) before any worker or OpenMP thread starts.

    Memory freed in one thread's arena serves only that arena, so with the worker, OpenMP's and the event loop's
    threads all allocating, RSS crept up under load (past the soak's check between its first mark and its end);
    two arenas keep it flat at no measured cost to prefill or decode (bench/RESULTS.md#issue-17-malloc-arenas).
    False where the C library is not glibc (nothing to do there)."""
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(_M_ARENA_MAX, arenas))
    except (OSError, AttributeError):
        return False


def trim_malloc() -> None:
    """Hand the heap pages freed since back to the OS (glibc keeps them resident otherwise); nothing elsewhere."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


_M_ARENA_MAX = -8  # glibc's malloc.h
