"""The host time of one scheduler step per running sequence, without a model: what a GPU step's Python costs.

A stand-in runner returns ready logits at once, so a step's time is all Python: scheduling, block bookkeeping, the
graph inputs the runner would fill, sampling (greedy or sampled), stop checks and detokenization, events. On a GPU
this is what the worker does around each graph replay (bench/RESULTS.md#issue-13-scheduler-overhead). Prints µs
per sequence per step for several batch sizes and a cProfile of the largest.

    .venv/bin/python bench/scheduler_overhead.py --batches 1 32 128 --steps 200
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import pstats
import sys
import time

import torch

from engine import load_runner
from engine.model.batch import StepRow
from engine.runtime.cuda_graphs import StepStaging, table_width
from server.scheduling.generation import Generation
from server.sampling.params import SamplingParams
from server.scheduling.scheduler import Scheduler


class InstantRunner:
    """The real runner's bookkeeping (blocks, rows, the graph staging), with logits ready at once."""

    def __init__(self, runner, max_batch: int) -> None:
        self.real = runner
        self.blocks, self.tokenizer, self.vocab_size = runner.blocks, runner.tokenizer, runner.vocab_size
        self.device, self.context_size = runner.device, runner.context_size
        # The pool operations the scheduler calls per sequence, as the real runner has them (not through __getattr__)
        self.can_allocate, self.allocate = runner.can_allocate, runner.allocate
        bs = runner.blocks.block_size
        self.staging = StepStaging(max_batch, table_width(runner.context_size, bs), runner.blocks.num_blocks * bs,
                                   runner.device)
        self.logits = torch.randn(max_batch, runner.vocab_size)

    def __getattr__(self, name):
        return getattr(self.real, name)

    def step(self, rows: list[StepRow]) -> torch.Tensor:
        errors = self.real.row_errors(rows)
        assert not errors, errors
        for row in rows:
            self.blocks.allocate(row.seq, row.end)
        self.blocks.take_copies()
        if all(r.end - r.start == 1 for r in rows):
            self.staging.fill(rows, self.blocks.block_size)
        for row in rows:
            row.seq.num_computed = row.end
            self.blocks.commit(row.seq)
        return self.logits[:len(rows)]


def measure(runner, batch: int, steps: int, sampled: bool, profile: bool) -> float:
    async def main() -> float:
        sched = Scheduler(InstantRunner(runner, batch), max_batched_tokens=max(512, batch), max_running=batch)
        params = SamplingParams(temperature=0.8, top_p=0.95, seed=1) if sampled else SamplingParams(temperature=0)
        for i in range(batch):
            sched.add(Generation(prompt_ids=[10 + i, 20, 30, 40], params=params, max_tokens=10 ** 6,
                                 ignore_eos=True))
        for _ in range(3):  # prefill and the first decode steps
            sched.step()
        prof = cProfile.Profile() if profile else None
        t0 = time.perf_counter()
        if prof:
            prof.enable()
        for _ in range(steps):
            sched.step()
            await asyncio.sleep(0)  # deliver the events (the event loop's share is not counted here)
        if prof:
            prof.disable()
            pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(25)
        return (time.perf_counter() - t0) / steps / batch * 1e6

    return asyncio.run(main())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 32, 128])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--profile", action="store_true", help="cProfile the largest batch (to stderr)")
    ap.add_argument("--model", default="smollm2-135m",
                    help="a known name or a path (a small vocabulary keeps the CPU's argmax out of the figure)")
    args = ap.parse_args()
    runner = load_runner(args.model, kv_cache_memory=1 << 30)
    gc.collect()
    gc.freeze()  # as the server's WorkerPool does when serving starts
    print("| batch | greedy µs / sequence / step | sampled (T 0.8, top-p 0.95, seed) |")
    print("|---|---|---|")
    for b in args.batches:
        greedy = measure(runner, b, args.steps, False, args.profile and b == max(args.batches))
        sampled = measure(runner, b, args.steps, True, False)
        print(f"| {b} | {greedy:.1f} | {sampled:.1f} |")


if __name__ == "__main__":
    main()
