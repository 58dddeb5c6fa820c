"""The engine process's main (`serve_engine`): load the model as the one-process server does, serve its worker pool,
and answer the HTTP processes' pipes (server/process/client.py has the other end): the main HTTP process's, whose
stop or departure stops the engine, and one per further HTTP process (`--api-server-count`, server/launch/http_fronts.py),
whose departure cancels only what it had submitted."""
from __future__ import annotations

import logging
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from collections.abc import Callable
from typing import Any

from server.scheduling.embedding_jobs import EmbeddingJob
from server.process.wire import ToClient, ToEngine, encode_event, is_final
from server.errors import APIError
from server.scheduling.generation import Generation, GenerationFailed, Submission
from server.grammar.compiler import GrammarCompiler, StructuredOutputError
from server.process.response_store import ResponseStore
from server.config.settings import Settings
from server.logs import configure_logging
from server.scheduling.loading import load_model
from server.scheduling.threads import GIL_SWITCH_INTERVAL_S, cap_malloc_arenas

log = logging.getLogger("emberserve.engine_process")
_STORE_LOCK = threading.Lock()  # the shared response store, used from every pipe's thread


class EngineSide:
    """The engine process's end of the pipe: builds each submission for the pool and sends its events back
    (the `sink` of every Generation and EmbeddingJob it holds)."""

    def __init__(self, conn: Connection, store: ResponseStore | None = None) -> None:
        self._conn = conn
        self._store = store  # the stored responses that every HTTP process shares (None: each keeps its own)
        self._send_lock = threading.Lock()
        self._subs: dict[int, Submission] = {}
        self._id_of: dict[Submission, int] = {}
        self._paused: set[Submission] = set()
        self._gone = False  # the HTTP process is: nothing more is sent
        # A constrained generation's grammar compiles off the pipe's thread (a slow one must not hold back the
        # other requests' submissions, cancellations and stats), as in one process it does off the event loop.
        self._compiles = ThreadPoolExecutor(max_workers=2, thread_name_prefix="engine-grammar")
        self._compiling: set[int] = set()  # ids whose grammar compiles: cancelled by leaving this set
        self._lock = threading.Lock()      # a submission's registration against its cancellation

    def send(self, kind: ToClient, *payload: Any) -> None:
        """Send the HTTP process a message (its kind as the plain string: server/process/wire.py)."""
        if self._gone:
            return
        try:
            with self._send_lock:
                self._conn.send((kind.value, *payload))
        except OSError:
            self._gone = True

    # EventSink: called by the scheduler's worker thread
    def deliver(self, batch: list[tuple[Submission, Any]]) -> None:
        wire = []
        for sub, event in batch:
            gid = self._id_of.get(sub)
            if gid is None:
                continue  # cancelled since
            wire.append((gid, encode_event(event)))
            if is_final(event):
                self._drop(gid)
        if wire:
            self.send(ToClient.EVENTS, wire)

    def backlogged(self, gen: Generation) -> bool:
        return gen in self._paused

    def _drop(self, gid: int) -> Submission | None:
        sub = self._subs.pop(gid, None)
        if sub is not None:
            self._id_of.pop(sub, None)
            self._paused.discard(sub)
        return sub

    def serve(self, state: Any) -> bool:
        """Answer this pipe's HTTP process until it says stop (True) or goes away (False)."""
        while True:
            try:
                messages = self._conn.recv()  # what the HTTP process queued in one turn of its event loop
            except (EOFError, OSError):
                return False
            for kind, *payload in messages:
                if kind == ToEngine.STOP:
                    return True
                self.HANDLERS[kind](self, state, *payload)

    def stop_compiling(self) -> None:
        self._compiles.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        """This HTTP process is done: what it submitted is cancelled, nothing more is sent to it."""
        self._gone = True
        self.stop_compiling()
        with self._lock:
            self._compiling.clear()
            subs = list(self._subs.values())
            self._subs.clear()
            self._id_of.clear()
        for sub in subs:
            sub.cancel()

    # ---- the HTTP process's messages (server/process/wire.py's ToEngine; STOP is `serve`'s) ----
    def _on_generate(self, state: Any, gid: int, spec: dict[str, Any]) -> None:
        if spec["grammar"] is None:
            self._submit(state.pool, gid, self._generation(spec, state.grammars))
        else:
            self._compiling.add(gid)
            self._compiles.submit(self._compile_and_submit, state, gid, spec)

    def _on_embed(self, state: Any, gid: int, spec: dict[str, Any]) -> None:
        self._submit(state.pool, gid, EmbeddingJob(**spec, loop=None, channel=None, sink=self))

    def _on_cancel(self, state: Any, gid: int) -> None:
        with self._lock:
            self._compiling.discard(gid)
            sub = self._drop(gid)
        if sub is not None:
            sub.cancel()

    def _on_backlog(self, state: Any, gid: int, paused: bool) -> None:
        sub = self._subs.get(gid)
        if sub is not None:
            (self._paused.add if paused else self._paused.discard)(sub)

    def _on_stats(self, state: Any, call: int) -> None:
        self.send(ToClient.REPLY, call, state.pool.stats())  # a PoolStats (server/scheduling/model_state.py)

    def _on_store(self, state: Any, call: int, op: str, key: str, value: Any) -> None:
        with _STORE_LOCK:
            result = self._store.put(key, value) if op == "put" else getattr(self._store, op)(key)
        self.send(ToClient.REPLY, call, result)

    # Every ToEngine kind but STOP, which `serve` answers itself (tests/server/process/test_engine_wire.py checks).
    HANDLERS: dict[str, Callable[..., None]] = {
        ToEngine.GENERATE: _on_generate, ToEngine.EMBED: _on_embed, ToEngine.CANCEL: _on_cancel,
        ToEngine.BACKLOG: _on_backlog, ToEngine.STATS: _on_stats, ToEngine.STORE: _on_store}

    def _generation(self, spec: dict[str, Any], grammars: GrammarCompiler) -> Generation | GenerationFailed:
        grammar = spec.pop("grammar")
        if grammar is not None:
            try:  # compiled and cached here too: a matcher cannot travel
                grammar = grammars.compile(grammar)
            except StructuredOutputError as e:
                return GenerationFailed(400, e.message)
        return Generation(**spec, grammar=grammar, loop=None, channel=None, sink=self)

    def _compile_and_submit(self, state: Any, gid: int, spec: dict[str, Any]) -> None:
        try:
            sub = self._generation(spec, state.grammars)
        except Exception:  # on an executor's thread, where nobody would see it: its request would wait forever
            log.exception("%s: compiling the output's grammar failed", spec.get("request_id"))
            sub = GenerationFailed(500, "internal error while compiling the output's grammar")
        with self._lock:
            if gid not in self._compiling:
                return  # cancelled while its grammar compiled
            self._compiling.discard(gid)
            self._register(gid, sub)  # before a cancellation can look for it
        self._submit(state.pool, gid, sub)

    def _register(self, gid: int, sub: Submission | GenerationFailed) -> None:
        if not isinstance(sub, GenerationFailed):
            self._subs[gid], self._id_of[sub] = sub, gid

    def _submit(self, pool: Any, gid: int, sub: Submission | GenerationFailed) -> None:
        if isinstance(sub, GenerationFailed):
            self.send(ToClient.EVENTS, [(gid, sub)])
            return
        self._register(gid, sub)  # again, where _compile_and_submit did: the same entries
        try:
            pool.submit(sub)
        except APIError as e:  # the pool's own limits (the HTTP side checks them first, so a race)
            self._drop(gid)
            self.send(ToClient.EVENTS, [(gid, GenerationFailed(e.status, e.message, e.code))])


def serve_engine(conns: list[Connection], settings: Settings) -> None:
    """The engine process: load the model as the one-process server does, then serve the HTTP processes' pipes
    (the first: the main HTTP process's, told the model is ready; the others' HTTP processes start after it)."""
    # Signals are the HTTP process's to act on (a drain needs the engine until its last stream ends); it says stop,
    # or its end of the pipe closes.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    cap_malloc_arenas()
    configure_logging(settings.log_level, settings.log_format)
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    store = ResponseStore(settings.responses_store_size, settings.responses_store_ttl) if len(conns) > 1 else None
    main, *fronts = [EngineSide(conn, store) for conn in conns]

    def worker_failed(worker: Any) -> None:  # on the worker's thread
        for side in (main, *fronts):
            side.send(ToClient.FAILED, f"{worker.name} stopped serving: {worker.failure}")

    try:
        state = load_model(settings, worker_failed)
    except Exception as e:
        log.debug("the model did not load", exc_info=e)
        main.send(ToClient.LOAD_FAILED, str(e))
        return
    main.send(ToClient.READY, state.model)

    serve_pipes(state, main, fronts)


def serve_pipes(state: Any, main: EngineSide, fronts: list[EngineSide]) -> None:
    """Serve every HTTP process's pipe (the others' on threads of their own) until the main one says stop or goes
    away; then stop the workers."""
    def serve_front(side: EngineSide, index: int) -> None:
        side.serve(state)
        log.info("HTTP process %d closed its pipe: its requests are cancelled", index)
        side.close()

    for i, side in enumerate(fronts, start=1):
        threading.Thread(target=serve_front, args=(side, i), name=f"engine-pipe-{i}", daemon=True).start()
    if not main.serve(state):
        log.warning("the HTTP process went away: stopping")
    for side in fronts:
        side.close()
    main.stop_compiling()
    state.pool.stop()
