"""Embedding requests on the worker: `EmbeddingJob` (one request's inputs and its channel back to the event loop)
and `EmbeddingSteps`, the queue of jobs the scheduler runs as forward passes of their own between its generation
steps.

A step embeds the waiting inputs, oldest job first, up to the scheduler's token budget (at least one input, so an
input longer than the budget still runs), many jobs' inputs in one batch. A decoder's inputs also need KV blocks
for the length of the pass: a step takes only as many as the pool holds now, and waits for generations to give
blocks back when it cannot hold the first. A job's vectors go back in one event once all its inputs are done.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine import Runner

from server.scheduling.generation import EventSink, GenerationFailed, Submission

log = logging.getLogger("emberserve.scheduler")


@dataclass(frozen=True)
class EmbeddingsDone:
    """Every input's embedding, [inputs, dim] float32 on the CPU, unit length, in the order of the inputs."""

    embeddings: torch.Tensor
    prompt_tokens: int


EmbeddingEvent = EmbeddingsDone | GenerationFailed


@dataclass(eq=False)  # identity: the queue keys its state by job
class EmbeddingJob(Submission):
    """The token ids of one request's inputs, the pooling asked for, and a thread-safe channel back."""

    inputs: list[list[int]]
    pooling: str | None = None        # None: the runner's own
    request_id: str = ""
    arrival: float = field(default_factory=time.perf_counter)
    loop: asyncio.AbstractEventLoop | None = field(default_factory=asyncio.get_running_loop)
    channel: asyncio.Queue[tuple[EmbeddingJob, EmbeddingEvent]] = field(default_factory=asyncio.Queue)
    sink: EventSink | None = None                          # as Generation's
    on_cancel: Callable[[EmbeddingJob], None] | None = None
    _cancelled: threading.Event = field(default_factory=threading.Event)


@dataclass(eq=False)
class _Progress:
    job: EmbeddingJob
    done: int = 0                                         # inputs embedded so far
    parts: list[torch.Tensor] = field(default_factory=list)


class EmbeddingSteps:
    """The embedding jobs of one runner, waiting or part done; `step()` embeds the next batch of their inputs."""

    def __init__(self, runner: Runner, max_batched_tokens: int) -> None:
        self.runner, self.max_batched_tokens = runner, max_batched_tokens
        self.pending: deque[_Progress] = deque()
        self._stepping: list[EmbeddingJob] = []  # the jobs of the step under way, failed together if it crashes

    def add(self, job: EmbeddingJob) -> None:
        self.pending.append(_Progress(job))

    def has_work(self) -> bool:
        return bool(self.pending)

    # Read from the event loop while the worker changes them: list() copies are atomic under the GIL.
    @property
    def num_jobs(self) -> int:
        return len(self.pending)

    @property
    def num_started(self) -> int:
        """Jobs with some inputs embedded."""
        return sum(1 for p in list(self.pending) if p.done)

    @property
    def num_waiting(self) -> int:
        """Jobs with none embedded yet."""
        return sum(1 for p in list(self.pending) if not p.done)

    def _pick(self) -> list[tuple[_Progress, list[list[int]]]]:
        """The inputs of the next step by job, oldest first, within the token budget and the free KV blocks; all
        of one pooling (the oldest job's)."""
        picked: list[tuple[_Progress, list[list[int]]]] = []
        lengths: list[int] = []
        tokens = 0
        pooling = self.pending[0].job.pooling
        for progress in self.pending:
            if progress.job.pooling != pooling:
                break
            taken: list[list[int]] = []
            for ids in progress.job.inputs[progress.done:]:
                if lengths and tokens + len(ids) > self.max_batched_tokens:
                    break
                lengths.append(len(ids))
                if not self.runner.embedding_fits(lengths):
                    lengths.pop()
                    if not lengths:
                        return []
                    break
                taken.append(ids)
                tokens += len(ids)
            if taken:
                picked.append((progress, taken))
            if len(taken) < len(progress.job.inputs) - progress.done:
                break  # this job's next input did not fit: later jobs wait their turn too
        return picked

    def step(self, alone: bool) -> bool:
        """Embed the next batch of inputs; False when nothing ran. `alone`: nothing else holds KV blocks that will
        come back, so an input the pool cannot hold now never fits: its job fails rather than waits."""
        for progress in [p for p in self.pending if p.job.cancelled]:
            self.pending.remove(progress)
        if not self.pending:
            return False
        picked = self._pick()
        if not picked:
            if alone:
                job = self.pending[0].job
                log.error("%s: the KV cache cannot hold an input of this request", job.request_id)
                self.fail([job], 500, "the KV cache cannot hold this input")
            return False
        self._stepping = [progress.job for progress, _ in picked]
        batch = [ids for _, taken in picked for ids in taken]
        vectors = self.runner.embed(batch, self.pending[0].job.pooling).cpu()
        offset = 0
        for progress, taken in picked:
            progress.parts.append(vectors[offset:offset + len(taken)])
            offset += len(taken)
            progress.done += len(taken)
            if progress.done == len(progress.job.inputs):
                self.pending.remove(progress)
                job = progress.job
                job.emit(EmbeddingsDone(torch.cat(progress.parts), sum(len(ids) for ids in job.inputs)))
        self._stepping = []
        return True

    def fail(self, jobs: list[EmbeddingJob], status: int, message: str, code: str | None = None) -> None:
        """End `jobs` with an error event and forget them."""
        for job in dict.fromkeys(jobs):
            held = [p for p in self.pending if p.job is job]
            for progress in held:
                self.pending.remove(progress)
            if held:
                job.emit(GenerationFailed(status, message, code))

    def fail_step(self, status: int, message: str) -> int:
        """Fail the jobs of the step that was under way (it crashed); returns how many."""
        jobs, self._stepping = self._stepping, []
        self.fail(jobs, status, message)
        return len(jobs)

    def fail_all(self, status: int, message: str) -> None:
        """Fail every job held (the worker cannot go on)."""
        self._stepping = []
        self.fail([p.job for p in self.pending], status, message)
