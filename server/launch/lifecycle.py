"""Graceful shutdown: on SIGTERM stop taking work (readiness 503), let in-flight requests finish within a grace
period, then exit 0. A second SIGTERM or a SIGINT stops at once, as plain uvicorn does."""
from __future__ import annotations

import logging
import signal
import socket
import threading
import time
from types import FrameType

import uvicorn
from fastapi import FastAPI

from server.api.state import app_state
from server.config.settings import Settings

log = logging.getLogger("emberserve")
POLL_S = 0.05
FINAL_CLOSE_S = 1  # after the drain: how long uvicorn waits for open responses before cancelling them
def serve_until_stopped(app: FastAPI, settings: Settings, sock: socket.socket | None = None, bind: bool = False) -> None:
    """Serve `app` with a `DrainingServer` until it stops: on `sock` (a socket another process bound and shares),
    on one bound here for the other HTTP processes to share (`bind`: its AppState's `listen_socket`), or on the
    settings' host and port."""
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            log_config=None, access_log=False, timeout_graceful_shutdown=FINAL_CLOSE_S)
    server = DrainingServer(config, app, grace=settings.shutdown_grace)
    state = app_state(app)
    state.request_shutdown = lambda: setattr(server, "should_exit", True)
    if bind:
        sock = state.listen_socket = config.bind_socket()
    server.run(sockets=None if sock is None else [sock])


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first SIGTERM drains the app before the usual shutdown."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, grace: float) -> None:
        super().__init__(config)
        self.app, self.grace = app, grace

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        state = app_state(self.app)
        if sig == signal.SIGTERM and not state.draining and not self.should_exit:
            # Not passed to uvicorn: it would re-raise the signal after shutting down, and the exit status
            # would be 143 instead of a clean 0.
            state.draining = True
            fronts = state.fronts
            if fronts is not None:  # the other HTTP processes drain beside this one (server/launch/http_fronts.py)
                fronts.terminate()
            threading.Thread(target=self._drain, name="drain", daemon=True).start()
            return
        super().handle_exit(sig, frame)

    def _drain(self) -> None:
        state = app_state(self.app)
        deadline = time.monotonic() + self.grace
        log.info("SIGTERM: not taking new requests; waiting up to %.0fs for %d in flight", self.grace,
                 state.in_flight)
        while state.in_flight > 0 and time.monotonic() < deadline and not self.should_exit:
            time.sleep(POLL_S)
        if state.in_flight > 0:
            log.warning("grace period over: stopping with %d requests still in flight", state.in_flight)
        else:
            log.info("drained: no request in flight")
        self.should_exit = True
