"""Graceful shutdown: on SIGTERM stop taking work (readiness 503), let in-flight requests finish within a grace
period, then exit 0. A second SIGTERM or a SIGINT stops at once, as plain uvicorn does."""
from __future__ import annotations

import logging
import signal
import threading
import time
from types import FrameType

import uvicorn
from fastapi import FastAPI

log = logging.getLogger("emberserve")
POLL_S = 0.05


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first SIGTERM drains the app before the usual shutdown."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, grace: float) -> None:
        super().__init__(config)
        self.app, self.grace = app, grace

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and not self.app.state.draining and not self.should_exit:
            # Not passed to uvicorn: it would re-raise the signal after shutting down, and the exit status
            # would be 143 instead of a clean 0.
            self.app.state.draining = True
            fronts = self.app.state.fronts
            if fronts is not None:  # the other HTTP processes drain beside this one (server/http_fronts.py)
                fronts.terminate()
            threading.Thread(target=self._drain, name="drain", daemon=True).start()
            return
        super().handle_exit(sig, frame)

    def _drain(self) -> None:
        state = self.app.state
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
