"""`Worker`: a thread that owns a Runner and its Scheduler; `WorkerPool`: routing and the bounded queue."""
from __future__ import annotations

import logging
import queue
import threading

import torch

from engine import Runner
from engine.errors import EngineError

from .errors import APIError
from .generation import Generation, GenerationFailed
from .scheduler import Scheduler

log = logging.getLogger("emberserve.worker")
RETRY_AFTER_S = "2"


class Worker:
    """Owns one runner on one thread: takes submitted Generations and steps the scheduler while there is work."""

    def __init__(self, runner: Runner, name: str = "worker-0", max_batched_tokens: int = 512,
                 max_running: int = 32, threads: int | None = None) -> None:
        self.runner, self.threads = runner, threads  # threads: torch intra-op threads of this worker (None: as set)
        self.scheduler = Scheduler(runner, max_batched_tokens=max_batched_tokens, max_running=max_running)
        self._inbox: queue.SimpleQueue[Generation | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._stopping = False

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = 5.0) -> None:
        self._stopping = True
        self._inbox.put(None)
        self._thread.join(timeout)

    def submit(self, gen: Generation) -> None:
        self._inbox.put(gen)

    # Read from the event loop while the worker thread changes them: list() copies are atomic under the GIL,
    # and a slightly stale count is fine for routing and /health.
    @property
    def running(self) -> int:
        return len({u.gen for u in list(self.scheduler.running)})

    @property
    def queued(self) -> int:
        return self._inbox.qsize() + len({u.gen for u in list(self.scheduler.waiting)} -
                                         {u.gen for u in list(self.scheduler.running)})

    @property
    def load(self) -> int:
        return self._inbox.qsize() + self.scheduler.num_generations

    @property
    def generated_tokens(self) -> int:
        return self.scheduler.generated_tokens

    def _take_submissions(self) -> None:
        block = not self.scheduler.has_work()
        while True:
            try:
                gen = self._inbox.get(block=block)
            except queue.Empty:
                return
            block = False
            if gen is None:
                return
            if not gen.cancelled:
                self.scheduler.add(gen)

    def _run(self) -> None:
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        while not self._stopping:
            try:
                self._take_submissions()
                if not self.scheduler.has_work():
                    continue
                self.scheduler.step()
            except EngineError as e:  # e.g. a sequence past the context: the request's fault, said plainly
                for gen in self.scheduler.fail_all():
                    gen.emit(GenerationFailed(400, str(e)))
            except Exception:
                log.exception("a batch step failed; failing its generations")
                for gen in self.scheduler.fail_all():
                    gen.emit(GenerationFailed(500, "internal error while generating"))


class WorkerPool:
    """Routes each Generation to the least loaded worker; past `max_queued` waiting requests, answers 429."""

    def __init__(self, workers: list[Worker], max_queued: int) -> None:
        self.workers, self.max_queued = workers, max_queued

    def start(self) -> None:
        for w in self.workers:
            w.start()

    def stop(self) -> None:
        for w in self.workers:
            w.stop()

    def submit(self, gen: Generation) -> None:
        worker = min(self.workers, key=lambda w: w.load)
        if worker.queued >= self.max_queued:
            raise APIError(429, f"the server is busy: {worker.queued} requests are waiting; retry shortly",
                           code="queue_full", headers={"Retry-After": RETRY_AFTER_S})
        worker.submit(gen)

    @property
    def running(self) -> int:
        return sum(w.running for w in self.workers)

    @property
    def queued(self) -> int:
        return sum(w.queued for w in self.workers)

    @property
    def generated_tokens(self) -> int:
        return sum(w.generated_tokens for w in self.workers)

    def stats(self) -> dict[str, int]:
        """Load and KV-cache figures summed over the workers (cached but unreferenced blocks count as free)."""
        blocks = [w.runner.blocks for w in self.workers]
        return {"running": self.running, "queued": self.queued, "generated_tokens": self.generated_tokens,
                "kv_blocks_total": sum(b.num_blocks for b in blocks), "kv_blocks_used": sum(b.num_used for b in blocks),
                "prefix_cache_queried_tokens": sum(b.queries for b in blocks),
                "prefix_cache_hit_tokens": sum(b.hits for b in blocks),
                "preemptions": sum(w.scheduler.preemptions for w in self.workers)}
