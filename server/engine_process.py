"""The engine in a process of its own beside the HTTP server: `EngineClient`, the HTTP process's handle on it (what
the serving layer uses of a `WorkerPool`). The engine process's side is server/engine_core.py; what crosses
between them, server/engine_wire.py.

In one process the worker thread's Python (scheduling, detokenizing, stop checks) and the event loop's (parsing
requests, writing a few hundred streams) take turns on one GIL, and on a GPU the device then waits for both
(bench/RESULTS.md, issue 13). Here the engine process runs the model, its scheduler and workers exactly as the
one-process server does; the HTTP process tokenizes, validates, compiles grammars (to answer a bad one with a
400) and streams. One duplex pipe joins them: submissions, cancellations and a reader's backlog go one way, each
scheduler step's events (one message for all its streams), stats and failures the other way.
"""
from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import multiprocessing
import queue
import threading
from collections.abc import Callable
from contextlib import suppress
from typing import Any

from .embedding_jobs import EmbeddingJob
from .engine_core import serve_engine
from .engine_wire import GENERATION_FIELDS, JOB_FIELDS, ServedModel, decode_event, is_final
from .generation import Generation, GenerationFailed, Submission, hand_over
from .settings import Settings
from .worker import queue_full_error, worker_failed_error

log = logging.getLogger("emberserve.engine_process")
STOP_TIMEOUT_S = 30.0    # for the engine process to stop its workers and exit, then it is killed
STATS_TIMEOUT_S = 5.0    # for an answer to a stats request; past it, the last answer
BACKLOG_POLL_S = 0.05    # how often a paused reader's backlog is looked at again
ENGINE_GONE = "the engine process stopped; the server is restarting"


class EngineClient:
    """The HTTP process's handle on the engine process: `submit`, `stats`, `failure`, `stop` as `WorkerPool`'s.

    Made on the event loop, it starts the process; `wait_ready` (blocking: on a thread) waits for its model and
    returns what the HTTP side serves from. `on_failure(reason)` is told, from the reader thread, when the engine
    stops serving (a worker failed, or the process died); every request it held then fails with a 500.
    """

    def __init__(self, settings: Settings, on_failure: Callable[[str], None] | None = None) -> None:
        self.max_queued = settings.max_queued
        self.on_failure = on_failure
        self.failure: str | None = None
        context = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
        self._conn, child = context.Pipe()
        # Not a daemon: a tensor-parallel engine spawns its ranks from there.
        self._process = context.Process(target=serve_engine, args=(child, settings), name="emberserve-engine")
        self._process.start()
        child.close()
        self._loop = asyncio.get_running_loop()
        self._send_lock = threading.Lock()
        self._outbox: list[tuple[Any, ...]] = []  # messages for the engine, written together (see `_send`)
        self._flush_scheduled = False
        # Writes happen on a thread of their own: a burst's batch can be more than the pipe holds, and the event
        # loop must not wait for the engine process to read it.
        self._batches: queue.SimpleQueue[list[tuple[Any, ...]] | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_batches, name="engine-writer", daemon=True)
        self._writer.start()
        self._ids = itertools.count()
        self._live: dict[int, Submission] = {}       # submitted, not ended: by id
        self._id_of: dict[Submission, int] = {}
        self._waiting: set[int] = set()              # submitted, no event yet: queued in the engine
        self._paused: dict[int, Submission] = {}     # told to wait for their reader
        self._stats: dict[str, Any] = {}
        self._stats_reply = threading.Event()
        self._stats_lock = threading.Lock()
        self._stopping = False
        self._reader: threading.Thread | None = None

    def wait_ready(self) -> ServedModel:
        """Block until the engine process has loaded the model (ValueError with its reason when it cannot)."""
        try:
            kind, payload = self._conn.recv()
        except (EOFError, OSError):
            self._process.join(STOP_TIMEOUT_S)
            raise ValueError(f"the engine process exited while loading (exit code {self._process.exitcode})") from None
        if kind == "load_failed":
            self._process.join(STOP_TIMEOUT_S)
            raise ValueError(payload)
        self._reader = threading.Thread(target=self._read, name="engine-reader", daemon=True)
        self._reader.start()
        return payload

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def kill(self) -> None:
        """End the engine process now (a load cancelled by a signal: nothing of it is worth keeping)."""
        self._stopping = True
        self._process.kill()

    def stop(self) -> None:
        """Ask the engine to stop its workers and exit; killed past STOP_TIMEOUT_S."""
        self._stopping = True
        self._send(("stop",), now=True)
        self._batches.put(None)
        self._writer.join(STOP_TIMEOUT_S)
        self._process.join(STOP_TIMEOUT_S)
        if self._process.is_alive():
            log.warning("the engine process did not stop in %.0f s: killed", STOP_TIMEOUT_S)
            self._process.kill()
            self._process.join()
        if self._reader is not None:
            self._reader.join(STOP_TIMEOUT_S)
        self._conn.close()
        gc.unfreeze()  # frozen once serving started (server/app.py), as WorkerPool.stop undoes its own

    # ---- the pool's interface ----
    def submit(self, sub: Generation | EmbeddingJob) -> None:
        if self.failure is not None:
            raise worker_failed_error()
        if len(self._waiting) >= self.max_queued:  # the engine's requests with no event yet (over all its workers)
            raise queue_full_error(len(self._waiting))
        gid = next(self._ids)
        if isinstance(sub, Generation):
            spec = {name: getattr(sub, name) for name in GENERATION_FIELDS}
            spec["grammar"] = None if sub.grammar is None else sub.grammar.spec
            message: tuple[Any, ...] = ("generate", gid, spec)
        else:
            message = ("embed", gid, {name: getattr(sub, name) for name in JOB_FIELDS})
        self._live[gid], self._id_of[sub] = sub, gid
        self._waiting.add(gid)
        sub.on_cancel = self._cancel
        if self.failure is not None and self._forget(gid) is not None:  # the engine failed since the check above
            raise worker_failed_error()
        self._send(message)

    def stats(self) -> dict[str, Any]:
        """The engine's `WorkerPool.stats()`, asked for now (the last answer if the engine does not answer)."""
        with self._stats_lock:
            self._stats_reply.clear()
            self._send(("stats",), now=True)
            self._stats_reply.wait(STATS_TIMEOUT_S)
            return self._stats

    # ---- the HTTP process's side of the wire ----
    def _send(self, message: tuple[Any, ...], now: bool = False) -> None:
        """Queue a message for the engine: those of one event-loop turn go in one write, so that a burst of
        requests costs the engine process one wake-up (and one turn of its GIL), not one each. `now`: hand it on
        with what is queued without waiting for the turn to end (any thread). Messages keep their order."""
        with self._send_lock:
            self._outbox.append(message)
            if now:
                self._hand_to_writer()
            elif not self._flush_scheduled:
                self._flush_scheduled = True
                self._loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        with self._send_lock:
            self._flush_scheduled = False
            self._hand_to_writer()

    def _hand_to_writer(self) -> None:
        if self._outbox:
            batch, self._outbox = self._outbox, []
            self._batches.put(batch)

    def _write_batches(self) -> None:
        """The writer thread: each batch in one write, in order, until stop (or the engine is gone: the reader
        thread then fails what it held)."""
        while (batch := self._batches.get()) is not None:
            try:
                self._conn.send(batch)
            except OSError:
                return

    def _forget(self, gid: int) -> Submission | None:
        sub = self._live.pop(gid, None)
        if sub is not None:
            self._id_of.pop(sub, None)
        self._waiting.discard(gid)
        self._paused.pop(gid, None)
        return sub

    def _cancel(self, sub: Submission) -> None:
        """`on_cancel` of every submission: the engine drops it at its next step, and nothing more comes back."""
        gid = self._id_of.get(sub)
        if gid is None:
            return  # it had ended
        self._forget(gid)
        self._send(("cancel", gid))

    def _read(self) -> None:
        """The reader thread: each step's events to their event loops, the stats, the engine's failure."""
        while True:
            try:
                if self._paused:
                    self._resume_readers()
                if not self._conn.poll(BACKLOG_POLL_S):
                    continue
                kind, *payload = self._conn.recv()
            except (EOFError, OSError):
                break
            if kind == "events":
                self._dispatch(payload[0])
            elif kind == "stats":
                self._stats = payload[0]
                self._stats_reply.set()
            elif kind == "failed":
                self._fail(payload[0], end_requests=False)  # the engine fails what it held itself
            elif kind == "stopped":
                break
        if not self._stopping:
            self._process.join(1.0)
            self._fail(f"the engine process exited (exit code {self._process.exitcode})", end_requests=True)
        self._stats_reply.set()

    def _dispatch(self, wire: list[tuple[int, Any]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Submission, Any]]] = {}
        arrived: dict[int, int] = {}
        for gid, item in wire:
            sub = self._live.get(gid)
            if sub is None:
                continue  # cancelled: what was on its way is dropped
            event = decode_event(item)
            if is_final(event):
                self._forget(gid)
            else:
                self._waiting.discard(gid)
                arrived[gid] = arrived.get(gid, 0) + 1
            by_loop.setdefault(sub.loop, []).append((sub, event))
        for loop, batch in by_loop.items():
            with suppress(RuntimeError):  # a closed event loop: nobody waits there any more
                hand_over(loop, batch)
        for gid, count in arrived.items():  # a reader this far behind: the engine waits for it (max_backlog)
            sub = self._live.get(gid)
            limit = getattr(sub, "max_backlog", None)
            if limit is not None and gid not in self._paused and sub.channel.qsize() + count >= limit:
                self._paused[gid] = sub
                self._send(("backlog", gid, True))

    def _resume_readers(self) -> None:
        for gid, sub in list(self._paused.items()):
            if sub.channel.qsize() < sub.max_backlog:
                del self._paused[gid]
                self._send(("backlog", gid, False))

    def _fail(self, reason: str, end_requests: bool) -> None:
        if self.failure is None:
            self.failure = reason
            log.critical("%s", reason)
            if self.on_failure is not None:
                self.on_failure(reason)
        if end_requests:
            for gid in list(self._live):
                sub = self._forget(gid)
                if sub is not None:
                    with suppress(RuntimeError):  # its event loop has closed: nobody waits there any more
                        hand_over(sub.loop, [(sub, GenerationFailed(500, ENGINE_GONE))])
