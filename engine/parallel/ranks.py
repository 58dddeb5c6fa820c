"""The processes of a tensor-parallel runner: rank 0 (the caller: scheduler, sampler, HTTP) spawns ranks 1..N-1
with torch.multiprocessing, they meet over torch.distributed (nccl on CUDA, one GPU each; gloo on CPU), each loads
its share of the model and its own KV pool, and ranks 1..N-1 then run every step rank 0 broadcasts
(engine/parallel/messages.py) until it says stop.

Rank 0 watches the other ranks' processes: one that dies fails the group at once (its `failure`, the callbacks
given to `on_failure`, the remaining ranks stopped), so a step never waits on a rank that is gone; a rank whose
parent dies exits too.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_for_exit

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.model.batch import ForwardBatch
from engine.parallel.messages import MODE_STOP, StepMessage, send_step

log = logging.getLogger("emberserve.engine")

STORE_HOST = "127.0.0.1"
JOIN_TIMEOUT_S = 300.0   # for the ranks' processes to start and reach the rendezvous
STOP_TIMEOUT_S = 10.0    # for them to exit after the stop message, before they are terminated
_POLL_S = 0.05


class TensorParallelFailure(RuntimeError):
    """A rank of a tensor-parallel runner is gone (or out of step): the runner cannot run steps any more."""


@dataclass(frozen=True)
class RankGroup:
    """This process's place in a tensor-parallel group: its rank, the group's size, the process group, its device."""

    rank: int
    size: int
    group: dist.ProcessGroup
    device: torch.device

    @property
    def name(self) -> str:
        """The process group's name, which the layers' functional collectives take."""
        return self.group.group_name


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: the r-th GPU from the one asked for (cuda → cuda:0, cuda:1, ...); a CPU for every rank."""
    if device.type == "cuda":
        return torch.device("cuda", (device.index or 0) + rank)
    return device


def join_group(store: dist.Store, rank: int, size: int, device: torch.device) -> RankGroup:
    if device.type == "cuda":
        # NVLink multicast (NVLS) must stay off on the machines this runs on.
        os.environ["NCCL_NVLS_ENABLE"] = "0"
        torch.cuda.set_device(device)
    dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=size)
    return RankGroup(rank, size, dist.group.WORLD, device)


def exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


class RankProcesses:
    """Rank 0's handle on ranks 1..N-1: sends them each step, watches their processes, stops them."""

    def __init__(self, group: RankGroup, processes: list[mp.Process]) -> None:
        self.group, self.processes = group, processes
        self.failure: str | None = None  # why the group cannot run steps any more, once it cannot
        self._callbacks: list[Callable[[str], None]] = []
        self._lock = threading.Lock()
        self._closing = False
        threading.Thread(target=self._watch, name="tensor-parallel-watch", daemon=True).start()

    @property
    def size(self) -> int:
        return self.group.size

    def send(self, mode: int, copies: list[tuple[int, int]], batch: ForwardBatch | None) -> None:
        """Broadcast a step (or the stop) to the other ranks; TensorParallelFailure when the group is broken."""
        if self.failure is not None:
            raise TensorParallelFailure(self.failure)
        try:
            send_step(StepMessage(mode, copies, batch), self.group.group, self.group.device)
        except Exception as e:
            raise TensorParallelFailure(self.step_failed(e, "sending a step to the other ranks")) from e

    def step_failed(self, error: BaseException, doing: str) -> str:
        """Fail the group after `error` on rank 0 (a collective fails when a peer dies: then the reason is the
        rank that died, if it has exited within a second); returns the group's failure."""
        if self.failure is None:
            exited = wait_for_exit([p.sentinel for p in self.processes], timeout=1.0)
            dead = [(rank, p) for rank, p in enumerate(self.processes, 1) if p.sentinel in exited]
            if dead:
                rank, p = dead[0]
                p.join(1.0)
                self.fail(f"tensor-parallel rank {rank} (pid {p.pid}) exited with {exit_text(p.exitcode)}")
            else:
                self.fail(f"{doing} failed on tensor-parallel rank 0: {type(error).__name__}: {error}")
        return self.failure or f"{type(error).__name__}: {error}"

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Call `callback(reason)` (from the watching thread) when the group fails; at once if it already has."""
        with self._lock:
            if self.failure is None:
                self._callbacks.append(callback)
                return
        callback(self.failure)

    def fail(self, reason: str) -> None:
        """Mark the group broken (the first reason stays), stop the other ranks and tell the callbacks."""
        with self._lock:
            if self.failure is not None or self._closing:
                return
            self.failure, callbacks = reason, list(self._callbacks)
        log.critical("%s; stopping the tensor-parallel ranks", reason)
        self._terminate()
        for callback in callbacks:
            callback(reason)

    def _watch(self) -> None:
        by_sentinel = {p.sentinel: (rank, p) for rank, p in enumerate(self.processes, 1)}
        ready = wait_for_exit(list(by_sentinel))
        rank, process = by_sentinel[ready[0]]
        process.join(1.0)
        self.fail(f"tensor-parallel rank {rank} (pid {process.pid}) exited with {exit_text(process.exitcode)}")

    def _terminate(self) -> None:
        for p in self.processes:
            if p.is_alive():
                p.terminate()
        for p in self.processes:
            p.join(STOP_TIMEOUT_S)
            if p.is_alive():
                p.kill()
                p.join()

    def close(self, graceful: bool = True) -> None:
        """Stop the other ranks. `graceful`: the caller's thread is the only one using the group (no step in
        flight), so the ranks get the stop message (when the group is sound) and the process group is left, ready
        for another; otherwise they are terminated and the group is left as it is (a thread may be inside one of its
        collectives: destroying it under that thread could hang)."""
        with self._lock:
            sound, self._closing = self.failure is None and not self._closing, True
        if sound and graceful:
            try:
                send_step(StepMessage(MODE_STOP), self.group.group, self.group.device)
            except Exception as e:  # noqa: BLE001 - they are terminated below either way
                log.warning("could not send the stop to the tensor-parallel ranks: %s", e)
            deadline = time.monotonic() + STOP_TIMEOUT_S
            for p in self.processes:
                p.join(max(0.0, deadline - time.monotonic()))
        self._terminate()
        if graceful and dist.is_initialized():
            dist.destroy_process_group(self.group.group)


def wait_joined(store: dist.Store, processes: list[mp.Process]) -> None:
    """Until every rank has reached the rendezvous; a rank that exits first (a bad install, a crash) fails it now
    rather than after the rendezvous' timeout."""
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    for rank, process in enumerate(processes, 1):
        while not store.check([f"joined/{rank}"]):
            if process.exitcode is not None:
                raise TensorParallelFailure(f"tensor-parallel rank {rank} (pid {process.pid}) exited with "
                                            f"{exit_text(process.exitcode)} while starting; its log says why")
            if time.monotonic() > deadline:
                raise TensorParallelFailure(f"tensor-parallel rank {rank} did not start within {JOIN_TIMEOUT_S:.0f}s")
            time.sleep(_POLL_S)


__all__ = ["RankGroup", "RankProcesses", "TensorParallelFailure", "backend_for", "join_group", "rank_device",
           "wait_joined", "exit_text"]
