"""More HTTP processes in front of the one engine process (`--api-server-count`, as vLLM's API-server count).

One HTTP process parses, validates and tokenizes every request and writes every stream on one core; with a few
hundred streams on a GPU that core, not the engine, sets the pace (bench/RESULTS.md#issue-13-gpu-engine-process).
The main process
(the CLI's) binds the port, starts the engine process (server/process/client.py) with a pipe for each HTTP
process and, once the model is loaded, starts the others here: each serves the same listening socket (the kernel
hands each new connection to one of them) through its own pipe to the engine, with the same app as the main one.
What must be one across them is: the engine's queues, stats and stored responses (the engine process holds
them) and the metrics (files that a scrape of any process sums: server/api/metrics.py).

The main process supervises: its SIGTERM drains the others too (they are sent SIGTERM), it stops the engine only
after they exit, and one that dies unexpectedly takes the server down (exit 4) for its supervisor to restart,
as a failed worker does. An HTTP process that loses the engine fails its requests and exits 4 by itself.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import socket
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection, wait

from server.api.app import create_app
from server.api.state import app_state
from server.api.metrics import MULTIPROCESS_ENV, share_metrics_across_processes
from server.config.settings import Settings
from server.launch.checks import EXIT_WORKER_FAILED
from server.launch.lifecycle import serve_until_stopped
from server.logs import configure_logging
from server.scheduling.model_state import ServedModel
from server.scheduling.threads import cap_malloc_arenas

log = logging.getLogger("emberserve")
STOP_MARGIN_S = 10.0  # past the drain's grace, for an HTTP process to exit before it is killed


class Fronts:
    """The HTTP processes the main one started: started with the engine's pipes for them, watched, stopped."""

    def __init__(self, settings: Settings, conns: list[Connection], served: ServedModel, sock: socket.socket,
                 on_exit: Callable[[str], None]) -> None:
        context = multiprocessing.get_context("spawn")
        self._grace = settings.shutdown_grace
        self._stopping = False
        self._processes = [context.Process(target=serve_front, args=(settings, conn, served, sock, i),
                                           name=f"emberserve-http-{i}") for i, conn in enumerate(conns, start=1)]
        for process, conn in zip(self._processes, conns):
            process.start()
            conn.close()  # the process has its own copy now
        self._watcher = threading.Thread(target=self._watch, args=(on_exit,), name="http-fronts", daemon=True)
        self._watcher.start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._processes if p.pid is not None]

    def terminate(self) -> None:
        """Begin the others' drain (SIGTERM: each stops taking requests and finishes its own), once: a second
        SIGTERM would stop a draining process at once, cutting its streams."""
        if self._stopping:
            return
        self._stopping = True
        for process in self._processes:
            if process.is_alive():
                process.terminate()

    def stop(self) -> None:
        """Drain them (if not begun), wait for them to exit, kill what is left after the grace (blocking)."""
        self.terminate()
        for process in self._processes:
            process.join(self._grace + STOP_MARGIN_S)
            if process.is_alive():
                log.warning("HTTP process %s did not exit: killed", process.name)
                process.kill()
                process.join()

    def _watch(self, on_exit: Callable[[str], None]) -> None:
        """Tell `on_exit` when one of them exits while the server is not stopping."""
        left = {p.sentinel: p for p in self._processes}
        while left and not self._stopping:
            for sentinel in wait(list(left), timeout=1.0):
                process = left.pop(sentinel)
                process.join()
                if not self._stopping and process.exitcode != 0:  # 0: a signal of its own (Ctrl-C reaches all)
                    on_exit(f"HTTP process {process.name} exited (exit code {process.exitcode})")
                    return


def serve_front(settings: Settings, conn: Connection, served: ServedModel, sock: socket.socket, index: int) -> None:
    """An HTTP process's main: the app over the engine's pipe `conn`, on the shared listening socket."""
    cap_malloc_arenas()
    configure_logging(settings.log_level, settings.log_format)
    share_metrics_across_processes(os.environ[MULTIPROCESS_ENV])
    app = create_app(settings, engine=(conn, served))
    log.debug("HTTP process %d serving", index)
    serve_until_stopped(app, settings, sock)
    if app_state(app).fatal_error:
        sys.exit(EXIT_WORKER_FAILED)
