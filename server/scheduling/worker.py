"""`Worker`: a thread that owns a Runner and its Scheduler; `WorkerPool`: routing and the bounded queue."""
from __future__ import annotations

import gc
import logging
import queue
import threading
from collections.abc import Callable

import torch

from engine import Runner
from engine.errors import EngineError

from server.scheduling.embedding_jobs import EmbeddingJob
from server.errors import APIError
from server.scheduling.generation import Generation, GenerationFailed
from server.scheduling.model_state import PoolStats
from server.scheduling.scheduler import Scheduler
from server.speculative.speculator import Speculator

log = logging.getLogger("emberserve.worker")
RETRY_AFTER_S = "2"
# Consecutive crashed steps after which a worker gives up: a device or model that fails every step is broken, and a
# restart (the server exits, its supervisor starts it again) serves better than failing every request forever.
MAX_FAILED_STEPS = 3


def worker_failed_error() -> APIError:
    """What a submission gets once the server cannot generate any more (it exits, and its supervisor restarts it)."""
    return APIError(503, "the server cannot generate (a worker failed) and is restarting; retry shortly",
                    code="worker_failed", headers={"Retry-After": RETRY_AFTER_S})


def queue_full_error(waiting: int) -> APIError:
    """What a submission gets past `--max-queued` waiting requests."""
    return APIError(429, f"the server is busy: {waiting} requests are waiting; retry shortly",
                    code="queue_full", headers={"Retry-After": RETRY_AFTER_S})


def freeze_heap() -> None:
    """Leave what is alive now to the end of serving (`gc.unfreeze()` when it stops).

    What is alive when serving starts (torch, the model, the tokenizer: a few hundred thousand objects) lives as
    long as the server. Left to the collector, each full collection walks all of it with the GIL held, a stall of
    every stream (bench/RESULTS.md#issue-13-gpu-deferred-text-frozen-heap); frozen, the collector looks only at what
    came since."""
    gc.collect()
    gc.freeze()


class WorkerBroken(Exception):
    """Raised on a worker's thread when it stops serving for good."""


class Worker:
    """Owns one runner on one thread: takes submitted Generations and steps the scheduler while there is work.

    A step that fails fails the requests in it (scheduler.fail_step) and the worker goes on. If its thread dies
    (MAX_FAILED_STEPS crashed steps in a row, or anything that escapes the loop), it fails every request it holds
    or is sent, sets `failure`, and calls `on_failure(self)` from its thread.
    """

    def __init__(self, runner: Runner, name: str = "worker-0", max_batched_tokens: int = 512,
                 max_running: int = 32, threads: int | None = None,
                 on_failure: Callable[[Worker], None] | None = None, speculator: Speculator | None = None,
                 async_scheduling: bool = False) -> None:
        self.runner, self.threads = runner, threads  # threads: torch intra-op threads of this worker (None: as set)
        self.name, self.on_failure = name, on_failure
        self.scheduler = Scheduler(runner, max_batched_tokens=max_batched_tokens, max_running=max_running,
                                   speculator=speculator, async_scheduling=async_scheduling)
        self._inbox: queue.SimpleQueue[Generation | EmbeddingJob | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._stopping = False
        self.failure: str | None = None  # why the worker stopped serving, once it has

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = 5.0) -> None:
        self._stopping = True
        self._inbox.put(None)
        self._thread.join(timeout)

    def submit(self, gen: Generation | EmbeddingJob) -> None:
        self._inbox.put(gen)

    def fail(self, reason: str) -> None:
        """Stop serving for good from outside the worker's thread (its runner broke: a tensor-parallel rank died):
        new submissions are refused, and `on_failure` is told. The thread's own step fails as the runner does."""
        if self.failure is None:
            self.failure = reason
            log.critical("%s stopped serving: %s", self.name, reason)
            if self.on_failure is not None:
                self.on_failure(self)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # Read from the event loop while the worker thread changes them: list() copies are atomic under the GIL,
    # and a slightly stale count is fine for routing and /health.
    @property
    def running(self) -> int:
        return len({u.gen for u in list(self.scheduler.running)}) + self.scheduler.embeddings.num_started

    @property
    def queued(self) -> int:
        """Requests submitted and not started yet (O(1): read on every submission)."""
        return self._inbox.qsize() + self.scheduler.num_waiting + self.scheduler.embeddings.num_waiting

    @property
    def load(self) -> int:
        return self._inbox.qsize() + self.scheduler.num_generations + self.scheduler.embeddings.num_jobs

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
        try:
            self._serve()
        except BaseException as e:  # the thread ends here: say why, and leave nobody waiting
            self.failure = f"{type(e).__name__}: {e}"
            log.critical("%s stopped serving: %s", self.name, self.failure, exc_info=not isinstance(e, WorkerBroken))
            self._fail_everything()
            if self.on_failure is not None:
                self.on_failure(self)

    def _serve(self) -> None:
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        failed_steps = 0
        while not self._stopping:
            self._take_submissions()
            if not self.scheduler.has_work():
                continue
            try:
                self.scheduler.step()
                failed_steps = 0
            except Exception as e:
                failed_steps += 1
                if isinstance(e, EngineError):  # a message meant for the user, said plainly
                    count = self.scheduler.fail_step(400, str(e))
                else:
                    count = self.scheduler.fail_step(500, "internal error while generating")
                log.error("a batch step failed (%d in a row); failed its %d requests", failed_steps, count,
                          exc_info=e)
                if failed_steps >= MAX_FAILED_STEPS:
                    raise WorkerBroken(f"{failed_steps} steps failed in a row; last: {type(e).__name__}: {e}") from e

    def _fail_everything(self) -> None:
        """Fail the generations held and those still in the inbox (submissions race with the failure)."""
        message = "the worker failed; the server is restarting"
        try:
            self.scheduler.fail_all(500, message)
        except BaseException:  # the scheduler itself may be what broke
            log.exception("%s: could not fail its held generations cleanly", self.name)
        while True:
            try:
                gen = self._inbox.get_nowait()
            except queue.Empty:
                return
            if gen is not None:
                gen.emit(GenerationFailed(500, message))


class WorkerPool:
    """Routes each Generation to the least loaded worker; past `max_queued` waiting requests, answers 429."""

    def __init__(self, workers: list[Worker], max_queued: int) -> None:
        self.workers, self.max_queued = workers, max_queued

    def start(self) -> None:
        freeze_heap()
        for w in self.workers:
            w.start()

    def stop(self) -> None:
        for w in self.workers:
            w.stop()
        gc.unfreeze()  # a process that serves again (tests, the Generator API) lets the collector free this one
        for w in self.workers:  # a tensor-parallel runner's ranks: stopped from here once its thread has ended
            if not w.alive:
                w.runner.close()
            elif w.runner.tensor_parallel is not None:
                log.warning("%s did not stop in time: its tensor-parallel ranks are terminated", w.name)
                w.runner.tensor_parallel.close(graceful=False)

    @property
    def failure(self) -> str | None:
        """Why a worker stopped serving (the first one's), or None while all serve."""
        return next((w.failure for w in self.workers if w.failure is not None), None)

    def submit(self, gen: Generation | EmbeddingJob) -> None:
        if self.failure is not None:
            raise worker_failed_error()
        worker = min(self.workers, key=lambda w: w.load)
        if worker.queued >= self.max_queued:
            raise queue_full_error(worker.queued)
        worker.submit(gen)
        if worker.failure is not None:  # it failed as this was sent: its inbox may have been emptied already
            gen.emit(GenerationFailed(500, "the worker failed; the server is restarting"))

    @property
    def running(self) -> int:
        return sum(w.running for w in self.workers)

    @property
    def queued(self) -> int:
        return sum(w.queued for w in self.workers)

    @property
    def generated_tokens(self) -> int:
        return sum(w.generated_tokens for w in self.workers)

    async def refresh_stats(self) -> None:
        """Nothing to fetch: `stats` reads the workers (the engine process's pool has to ask for them)."""

    def stats(self) -> PoolStats:
        """Load and KV-cache figures summed over the workers (cached but unreferenced blocks count as free), and
        speculative decoding's (vLLM's spec_decode names; the rates None without any draft)."""
        blocks = [w.runner.blocks for w in self.workers if w.runner.blocks is not None]  # an encoder has none
        spec = [w.scheduler.speculator.stats for w in self.workers if w.scheduler.speculator is not None]
        drafts, drafted = sum(s.num_drafts for s in spec), sum(s.num_draft_tokens for s in spec)
        accepted = sum(s.num_accepted_tokens for s in spec)
        method = next((w.scheduler.speculator.config.method for w in self.workers
                       if w.scheduler.speculator is not None), None)
        return PoolStats(
            running=self.running, queued=self.queued, generated_tokens=self.generated_tokens,
            kv_blocks_total=sum(b.num_blocks for b in blocks), kv_blocks_used=sum(b.num_used for b in blocks),
            prefix_cache_queried_tokens=sum(b.queries for b in blocks), prefix_cache_hit_tokens=sum(b.hits for b in blocks),
            preemptions=sum(w.scheduler.preemptions for w in self.workers),
            speculative=method, spec_decode_num_drafts=drafts, spec_decode_num_draft_tokens=drafted,
            spec_decode_num_accepted_tokens=accepted,
            spec_decode_num_accepted_tokens_per_pos=[sum(col) for col in zip(*(s.accepted_per_position for s in spec))],
            spec_decode_acceptance_rate=accepted / drafted if drafted else None,
            spec_decode_mean_acceptance_length=1 + accepted / drafts if drafts else None)
