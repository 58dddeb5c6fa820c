"""The engine in a process of its own beside the HTTP server: `EngineClient`, the HTTP process's handle on it (what
the serving layer uses of a `WorkerPool`). The engine process's side is server/process/engine.py; what crosses
between them, server/process/wire.py.

In one process the worker thread's Python (scheduling, detokenizing, stop checks) and the event loop's (parsing
requests, writing a few hundred streams) take turns on one GIL, and on a GPU the device then waits for both
(bench/RESULTS.md#issue-13-gpu-engine-process). Here the engine process runs the model, its scheduler and workers
exactly as the one-process server does; the HTTP process tokenizes, validates, compiles grammars (to answer a bad
one with a 400) and streams. One duplex pipe joins them: submissions, cancellations and a reader's backlog go one
way, each scheduler step's events (one message for all its streams), stats and failures the other way. Once the model is
loaded the HTTP process reads and writes its end on the event loop itself (an asyncio transport, in
multiprocessing's framing, so that the engine side keeps a plain Connection): a reader and a writer thread there
cost a GIL hand-off and a wake-up of the loop per step, beside the loop's own work (bench/http_cost.py).
"""
from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import multiprocessing
import os
import pickle
import socket
import struct
import threading
from collections.abc import Callable
from contextlib import suppress
from multiprocessing.connection import Connection
from typing import Any

from server.scheduling.embedding_jobs import EmbeddingJob
from server.errors import APIError
from server.process.engine import serve_engine
from server.process.wire import GENERATION_FIELDS, JOB_FIELDS, ToClient, ToEngine, decode_event, is_final
from server.scheduling.model_state import PoolStats, ServedModel
from server.scheduling.generation import Generation, GenerationFailed, Submission, hand_over
from server.config.settings import Settings
from server.scheduling.worker import queue_full_error, worker_failed_error

log = logging.getLogger("emberserve.engine_process")
STOP_TIMEOUT_S = 30.0    # for the engine process to stop its workers and exit, then it is killed
CALL_TIMEOUT_S = 5.0     # for the engine's answer to a call (stats, the response store)
BACKLOG_POLL_S = 0.05    # how often a paused reader's backlog is looked at again
_SIZE = struct.Struct("!i")      # multiprocessing.Connection's framing: a message's length, then its pickle
_BIG_SIZE = struct.Struct("!Q")  # after a length of -1, for a message of 2 GiB or more
ENGINE_GONE = "the engine process stopped; the server is restarting"


class EngineClient:
    """The HTTP process's handle on the engine process: `submit`, `stats`, `failure`, `stop` as `WorkerPool`'s.

    Made on the event loop, it starts the process; `wait_ready` (blocking: on a thread) waits for its model and
    returns what the HTTP side serves from, then `attach` (on the loop) serves the pipe from the loop.
    `on_failure(reason)` is told, on the loop, when the engine stops serving (a worker failed, or the process
    died); every request it held then fails with a 500.
    """

    def __init__(self, settings: Settings, on_failure: Callable[[str], None] | None = None, fronts: int = 0,
                 conn: Connection | None = None) -> None:
        """Start the engine process, with a pipe for this process and one for each of `fronts` more HTTP processes
        (`front_conns`, handed to them: server/launch/http_fronts.py); or, given `conn`, use an engine that another
        process started (in one of those HTTP processes)."""
        self.max_queued = settings.max_queued
        self.on_failure = on_failure
        self.failure: str | None = None
        self.front_conns: list[Connection] = []
        self._process: multiprocessing.process.BaseProcess | None = None
        if conn is None:
            context = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
            pipes = [context.Pipe() for _ in range(1 + fronts)]
            (conn, _), self.front_conns = pipes[0], [ours for ours, _ in pipes[1:]]
            # Not a daemon: a tensor-parallel engine spawns its ranks from there.
            self._process = context.Process(target=serve_engine, args=([theirs for _, theirs in pipes], settings),
                                            name="emberserve-engine")
            self._process.start()
            for _, theirs in pipes:
                theirs.close()
        self._conn = conn
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._transport: asyncio.Transport | None = None  # the pipe on the loop, once attached
        self._outbox: list[tuple[Any, ...]] = []  # messages for the engine, written together (see `_send`)
        self._flush_scheduled = False
        self._ids = itertools.count()
        self._live: dict[int, Submission] = {}       # submitted, not ended: by id
        self._id_of: dict[Submission, int] = {}
        self._waiting: set[int] = set()              # submitted, no event yet: queued in the engine
        self._paused: dict[int, Submission] = {}     # told to wait for their reader
        self._backlog_check: asyncio.TimerHandle | None = None
        self._stats = PoolStats()  # zeros until the engine's first answer
        self._calls: dict[int, asyncio.Future[Any]] = {}  # asked of the engine, not answered yet: by call id
        self._stopping = False

    def wait_ready(self) -> ServedModel:
        """Block until the engine process has loaded the model (ValueError with its reason when it cannot)."""
        try:
            kind, payload = self._conn.recv()  # ToClient.READY or LOAD_FAILED: the only messages before `attach`
        except (EOFError, OSError):
            self._process.join(STOP_TIMEOUT_S)
            raise ValueError(f"the engine process exited while loading (exit code {self._process.exitcode})") from None
        if kind == ToClient.LOAD_FAILED:
            self._process.join(STOP_TIMEOUT_S)
            raise ValueError(payload)
        assert kind == ToClient.READY, kind
        return payload

    async def attach(self) -> None:
        """Serve the pipe from the event loop from now on (after `wait_ready`)."""
        sock = socket.socket(fileno=os.dup(self._conn.fileno()))  # the transport's own descriptor
        self._transport, _ = await self._loop.create_unix_connection(lambda: _EngineProtocol(self), sock=sock)
        await self.refresh_stats()

    @property
    def pid(self) -> int | None:
        """The engine process's (None where this process did not start it)."""
        return None if self._process is None else self._process.pid

    def kill(self) -> None:
        """End the engine process now (a load cancelled by a signal: nothing of it is worth keeping)."""
        self._stopping = True
        if self._process is not None:
            self._process.kill()

    @property
    def in_flight(self) -> int:
        """Submissions not ended yet (requests and streams the engine is working on, or holds for their reader)."""
        return len(self._live)

    async def close(self) -> None:
        """Stop the engine process as `stop` does, without holding up the event loop: a model unloaded while the
        server serves its others."""
        self._stopping = True
        if self._transport is not None:
            self._send(ToEngine.STOP)  # written with this turn's other messages, before the wait below
        else:
            with suppress(OSError):
                self._conn.send([(ToEngine.STOP.value,)])
        if self._process is not None:
            await asyncio.to_thread(self._process.join, STOP_TIMEOUT_S)
            if self._process.is_alive():
                log.warning("the engine process did not stop in %.0f s: killed", STOP_TIMEOUT_S)
                self._process.kill()
                await asyncio.to_thread(self._process.join)
        if self._transport is not None:
            self._transport.abort()
        self._conn.close()

    def stop(self) -> None:
        """Ask the engine to stop its workers and exit; killed past STOP_TIMEOUT_S (blocking: the server's last act).
        In an HTTP process that did not start the engine: close this process's pipe (the engine cancels what
        came through it and serves on)."""
        self._stopping = True
        if self._process is None:
            if self._transport is not None:
                self._transport.abort()
            self._conn.close()
            gc.unfreeze()
            return
        # Written straight to the pipe: the loop does not run while this waits. Whatever the transport still holds
        # would come first; with a backlog there, the engine is not reading, and is killed below.
        transport = self._transport
        if transport is None or transport.get_write_buffer_size() == 0:
            with suppress(OSError):
                self._conn.send([(ToEngine.STOP.value,)])
        self._process.join(STOP_TIMEOUT_S)
        if self._process.is_alive():
            log.warning("the engine process did not stop in %.0f s: killed", STOP_TIMEOUT_S)
            self._process.kill()
            self._process.join()
        if transport is not None:
            transport.abort()
        self._conn.close()
        gc.unfreeze()  # frozen once serving started (server/api/app.py), as WorkerPool.stop undoes its own

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
            kind, payload = ToEngine.GENERATE, spec
        else:
            kind, payload = ToEngine.EMBED, {name: getattr(sub, name) for name in JOB_FIELDS}
        self._live[gid], self._id_of[sub] = sub, gid
        self._waiting.add(gid)
        sub.on_cancel = self._cancel
        self._send(kind, gid, payload)

    def stats(self) -> PoolStats:
        """The engine's `WorkerPool.stats()` as of the last `refresh_stats`."""
        return self._stats

    async def refresh_stats(self) -> None:
        """Ask the engine for its stats now and wait for them (unanswered or gone: the last answer stays)."""
        if self._transport is None or self.failure is not None:
            return
        with suppress(TimeoutError, APIError):
            self._stats = await self._call(ToEngine.STATS)

    async def store_call(self, op: str, key: str, value: Any = None) -> Any:
        """`op` ("get", "put", "delete") on the engine process's response store, which every HTTP process shares."""
        if self.failure is not None:
            raise worker_failed_error()
        try:
            return await self._call(ToEngine.STORE, op, key, value)
        except TimeoutError:
            raise APIError(503, "the engine process did not answer in time; retry", code="engine_busy") from None

    async def _call(self, kind: ToEngine, *args: Any) -> Any:
        """Ask the engine (`kind` with `args`) and wait for its answer: TimeoutError past CALL_TIMEOUT_S, the
        failure's APIError when the engine goes away meanwhile."""
        call = next(self._ids)
        reply = self._calls[call] = self._loop.create_future()
        self._send(kind, call, *args)
        try:
            return await asyncio.wait_for(reply, CALL_TIMEOUT_S)
        finally:
            self._calls.pop(call, None)

    # ---- the HTTP process's side of the wire, all on the event loop ----
    def _send(self, kind: ToEngine, *payload: Any) -> None:
        """Queue a message for the engine (its kind as the plain string: server/process/wire.py): those of one
        event-loop turn go in one write, so that a burst of requests costs the engine process one wake-up (and one
        turn of its GIL), not one each. Messages keep their order."""
        if threading.get_ident() != self._loop_thread:
            self._loop.call_soon_threadsafe(self._send, kind, *payload)
            return
        self._outbox.append((kind.value, *payload))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        batch, self._outbox = self._outbox, []
        if not batch or self._transport is None or self._transport.is_closing():
            return  # the engine is gone: what it held fails in `_lost`
        payload = pickle.dumps(batch, pickle.HIGHEST_PROTOCOL)
        if len(payload) > 0x7FFFFFFF:
            self._transport.write(_SIZE.pack(-1) + _BIG_SIZE.pack(len(payload)) + payload)
        else:
            self._transport.write(_SIZE.pack(len(payload)) + payload)

    def _forget(self, gid: int) -> Submission | None:
        sub = self._live.pop(gid, None)
        if sub is not None:
            self._id_of.pop(sub, None)
        self._waiting.discard(gid)
        self._paused.pop(gid, None)
        return sub

    def _cancel(self, sub: Submission) -> None:
        """`on_cancel` of every submission: the engine drops it at its next step, and nothing more comes back."""
        if threading.get_ident() != self._loop_thread:
            self._loop.call_soon_threadsafe(self._cancel, sub)
            return
        gid = self._id_of.get(sub)
        if gid is None:
            return  # it had ended
        self._forget(gid)
        self._send(ToEngine.CANCEL, gid)

    def _received(self, message: tuple[Any, ...]) -> None:
        """A message from the engine once attached: a step's events, the answer to a call, the engine's failure."""
        kind, *payload = message
        self.HANDLERS[kind](self, *payload)

    def _on_reply(self, call: int, value: Any) -> None:
        reply = self._calls.get(call)
        if reply is not None and not reply.done():
            reply.set_result(value)

    def _on_failed(self, reason: str) -> None:
        self._fail(reason, end_requests=False)  # the engine fails what it held itself

    def _dispatch(self, wire: list[tuple[int, Any]]) -> None:
        elsewhere: dict[asyncio.AbstractEventLoop, list[tuple[Submission, Any]]] = {}
        arrived: set[int] = set()
        for gid, item in wire:
            sub = self._live.get(gid)
            if sub is None:
                continue  # cancelled: what was on its way is dropped
            event = decode_event(item)
            if is_final(event):
                self._forget(gid)
            else:
                self._waiting.discard(gid)
                arrived.add(gid)
            if sub.loop is self._loop:
                sub.channel.put_nowait((sub, event))
            else:  # a submission made on another event loop
                elsewhere.setdefault(sub.loop, []).append((sub, event))
        for loop, batch in elsewhere.items():
            with suppress(RuntimeError):  # a closed event loop: nobody waits there any more
                hand_over(loop, batch)
        for gid in arrived:  # a reader this far behind: the engine waits for it (max_backlog)
            sub = self._live.get(gid)
            limit = getattr(sub, "max_backlog", None)
            if limit is not None and gid not in self._paused and sub.channel.qsize() >= limit:
                self._paused[gid] = sub
                self._send(ToEngine.BACKLOG, gid, True)
                if self._backlog_check is None:
                    self._backlog_check = self._loop.call_later(BACKLOG_POLL_S, self._resume_readers)

    # What answers each ToClient kind (tests/server/process/test_engine_wire.py checks that every kind has one): `_received`'s
    # table once attached, and `wait_ready` before.
    HANDLERS: dict[str, Callable[..., None]] = {
        ToClient.EVENTS: _dispatch, ToClient.REPLY: _on_reply, ToClient.FAILED: _on_failed}
    LOAD_MESSAGES = frozenset({ToClient.READY, ToClient.LOAD_FAILED})

    def _resume_readers(self) -> None:
        self._backlog_check = None
        for gid, sub in list(self._paused.items()):
            if sub.channel.qsize() < sub.max_backlog:
                del self._paused[gid]
                self._send(ToEngine.BACKLOG, gid, False)
        if self._paused:
            self._backlog_check = self._loop.call_later(BACKLOG_POLL_S, self._resume_readers)

    def _lost(self) -> None:
        """The pipe closed: the engine stopped, or died."""
        for reply in self._calls.values():
            if not reply.done():
                reply.set_exception(worker_failed_error())
        if self._stopping:
            return
        if self._process is None:
            self._fail("the engine process went away", end_requests=True)
            return

        async def report() -> None:
            await asyncio.to_thread(self._process.join, 1.0)
            self._fail(f"the engine process exited (exit code {self._process.exitcode})", end_requests=True)

        self._loop.create_task(report())

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


class EngineResponses:
    """The engine process's response store (`StoredResponses`), shared by the HTTP processes in front of it."""

    def __init__(self, client: EngineClient) -> None:
        self.client = client

    async def put(self, key: str, value: Any) -> None:
        await self.client.store_call("put", key, value)

    async def get(self, key: str) -> Any | None:
        return await self.client.store_call("get", key)

    async def delete(self, key: str) -> bool:
        return bool(await self.client.store_call("delete", key))


class _EngineProtocol(asyncio.Protocol):
    """The HTTP process's end of the pipe on the event loop: multiprocessing.Connection's frames, unpickled."""

    def __init__(self, client: EngineClient) -> None:
        self._client = client
        self._buffer = bytearray()

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        while len(buffer) >= _SIZE.size:
            (size,), start = _SIZE.unpack_from(buffer), _SIZE.size
            if size == -1:
                if len(buffer) < _SIZE.size + _BIG_SIZE.size:
                    return
                (size,), start = _BIG_SIZE.unpack_from(buffer, _SIZE.size), _SIZE.size + _BIG_SIZE.size
            if len(buffer) < start + size:
                return
            message = pickle.loads(buffer[start:start + size])
            del buffer[:start + size]
            self._client._received(message)

    def connection_lost(self, exc: Exception | None) -> None:
        self._client._lost()
