"""Launching a tensor-parallel runner: rank 0 spawns ranks 1..N-1 (engine/parallel/ranks.py has their handle),
each builds its share of the model (engine/loader/build.py) and then runs the steps rank 0 broadcasts."""
from __future__ import annotations

import logging
import os
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.loader.build import LoadOptions, build_runner
from engine.parallel.messages import MODE_HIDDEN, MODE_STOP, receive_step
from engine.parallel.ranks import (JOIN_TIMEOUT_S, STORE_HOST, RankGroup, RankProcesses, TensorParallelFailure,
                                   exit_text, join_group, rank_device, wait_joined)
from engine.runtime.runner import Runner
from engine.weights import Progress, no_progress

log = logging.getLogger("emberserve.engine")


def launch_ranks(options: LoadOptions, size: int, progress: Progress) -> Runner:
    """Rank 0's runner of a model split over `size` ranks, the other ranks spawned and serving."""
    device = rank_device(torch.device(options.device), 0)
    if device.type == "cuda":
        os.environ["NCCL_NVLS_ENABLE"] = "0"  # before the ranks are spawned: they inherit it
    store = dist.TCPStore(STORE_HOST, 0, size, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=JOIN_TIMEOUT_S))
    context = mp.get_context("spawn")
    processes = [context.Process(target=_rank_main, args=(options, rank, size, store.port, os.getpid()),
                                 name=f"tensor-parallel-rank-{rank}", daemon=True) for rank in range(1, size)]
    group = leader = None
    try:
        for rank, p in enumerate(processes, 1):
            p.start()
            log.info("tensor-parallel rank %d of %d: pid %d", rank, size, p.pid)
        wait_joined(store, processes)
        group = join_group(store, 0, size, device)
        leader = RankProcesses(group, processes)
        return build_runner(options, progress, group, leader)
    except BaseException as e:
        # A rank that failed to load exits (its traceback in the log): say so, rather than what the collective
        # rank 0 was waiting in made of it.
        processes = [p for p in processes if p.pid is not None]  # those started
        for p in processes:
            p.join(2.0)
        died = [(rank, p) for rank, p in enumerate(processes, 1) if p.exitcode not in (None, 0)]
        if leader is not None:
            leader.close(graceful=False)  # no stop message: the ranks may be anywhere in their loading
        for p in processes:
            if p.is_alive():
                p.kill()
            p.join()
        if group is not None and dist.is_initialized():  # nothing else uses it: left, so that a retry can join
            dist.destroy_process_group(group.group)
        if died and not isinstance(e, TensorParallelFailure):
            rank, p = died[0]
            raise TensorParallelFailure(f"tensor-parallel rank {rank} (pid {p.pid}) exited with "
                                        f"{exit_text(p.exitcode)} while loading; its log says why") from e
        raise


def _exit_with_parent(parent: int) -> None:
    """Exit when rank 0's process is gone (a rank blocked in a collective would otherwise wait on it forever)."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _rank_main(options: LoadOptions, rank: int, size: int, port: int, parent: int) -> None:
    """A spawned rank: meet the others, load this rank's share, then run rank 0's steps until it says stop."""
    _exit_with_parent(parent)
    logging.basicConfig(level=logging.WARNING, format=f"tensor-parallel rank {rank}: %(levelname)s %(message)s")
    device = rank_device(torch.device(options.device), rank)
    if device.type == "cpu":  # the ranks share the cores (torch's count: OMP_NUM_THREADS, else the cores)
        torch.set_num_threads(max(1, torch.get_num_threads() // size))
    store = dist.TCPStore(STORE_HOST, port, size, is_master=False, timeout=timedelta(seconds=JOIN_TIMEOUT_S))
    store.set(f"joined/{rank}", "1")
    group = join_group(store, rank, size, device)
    runner = build_runner(options, no_progress, group)
    serve_steps(runner, group)
    dist.destroy_process_group()


@torch.inference_mode()
def serve_steps(runner: Runner, group: RankGroup) -> None:
    """Run the forward pass of every step rank 0 broadcasts, over this rank's KV pool, until the stop message."""
    while True:
        message = receive_step(group.group, group.device)
        if message.mode == MODE_STOP:
            return
        runner.forward_batch(message.batch, message.copies, hidden_states=message.mode == MODE_HIDDEN)
