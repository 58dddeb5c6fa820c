"""A start-up progress bar for loading weights: redrawn in place on a terminal, a few log lines otherwise."""
from __future__ import annotations

import logging
import sys
import threading
import time
from typing import TextIO

log = logging.getLogger("emberserve")
WIDTH = 30
LOG_STEP = 25  # percent between log lines when stderr is not a terminal (containers, files)


class LoadProgress:
    """Called as `progress(stage, done, total)` by the engine's loader, from the loading thread."""

    def __init__(self, stream: TextIO | None = None, interactive: bool | None = None) -> None:
        self.stream = stream or sys.stderr
        self.interactive = self.stream.isatty() if interactive is None else interactive
        self.started = time.perf_counter()
        self.stage: str | None = None
        self.logged = -LOG_STEP
        self.lock = threading.Lock()

    def __call__(self, stage: str, done: int, total: int) -> None:
        with self.lock:
            if stage != self.stage:
                if self.stage is not None and self.interactive:
                    self.stream.write("\n")
                self.stage, self.logged = stage, -LOG_STEP
            percent = 100 * done // max(total, 1)
            if self.interactive:
                filled = WIDTH * done // max(total, 1)
                self.stream.write(f"\r{stage:<18} [{'#' * filled}{'.' * (WIDTH - filled)}] {percent:3d}% "
                                  f"{done}/{total} {time.perf_counter() - self.started:5.1f}s")
                if done >= total:
                    self.stream.write("\n")
                    self.stage = None
                self.stream.flush()
            elif percent - self.logged >= LOG_STEP or done >= total:
                self.logged = percent
                log.info("%s: %d%% (%d/%d)", stage, percent, done, total)
