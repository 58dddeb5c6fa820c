"""The scheduler in-process on a tiny model and a tiny KV pool: batching, chunking and preemption keep outputs."""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

from engine import load_runner  # noqa: E402
from engine.kv_cache import kv_bytes_per_token  # noqa: E402
from server.generation import ChoiceDelta, Generation, GenerationDone  # noqa: E402
from server.sampling import SamplingParams  # noqa: E402
from server.scheduler import Scheduler  # noqa: E402

PROMPTS = [[5 + i, 40 + 3 * i, 77, 12 + i] * (3 + i % 3) for i in range(6)]
MAX_TOKENS = 24


def _run(runner, prompts: list[list[int]], **scheduler_args) -> tuple[list[list[int]], Scheduler]:
    """Greedy generations for every prompt, all submitted at once; the tokens each one produced."""

    async def main() -> tuple[list[list[int]], Scheduler]:
        sched = Scheduler(runner, **scheduler_args)
        gens = [Generation(prompt_ids=p, params=SamplingParams(temperature=0), max_tokens=MAX_TOKENS,
                           ignore_eos=True) for p in prompts]
        for g in gens:
            sched.add(g)
        for _ in range(2000):
            if not sched.has_work():
                break
            sched.step()
        assert not sched.has_work()
        await asyncio.sleep(0)  # deliver the events the steps flushed
        out = []
        for g in gens:
            tokens, done = [], False
            while not g.events.empty():
                event = g.events.get_nowait()
                if isinstance(event, ChoiceDelta):
                    tokens += event.tokens
                done = done or isinstance(event, GenerationDone)
            assert done
            out.append(tokens)
        return out, sched

    return asyncio.run(main())


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import tiny_models  # tests/engine's random tiny models

    return tiny_models.build_tiny_model("qwen3", tmp_path_factory.mktemp("tiny")).gguf_path


def test_preemption_and_chunking_keep_greedy_outputs(tiny_path: Path) -> None:
    roomy = load_runner(tiny_path, dtype="float32")
    alone = [_run(roomy, [p])[0][0] for p in PROMPTS]
    assert all(len(t) == MAX_TOKENS for t in alone)
    per_token = kv_bytes_per_token(roomy.config, roomy.dtype)
    # 8 blocks of 16 tokens: six sequences of up to ~44 tokens cannot all stay resident
    tight = load_runner(tiny_path, dtype="float32", kv_cache_memory=per_token * 128, prefix_caching=False)
    together, sched = _run(tight, PROMPTS, max_batched_tokens=16)
    assert together == alone
    assert sched.preemptions > 0
    assert tight.blocks.num_used == 0


def test_batched_equals_alone_with_prefix_cache(tiny_path: Path) -> None:
    runner = load_runner(tiny_path, dtype="float32")
    alone = [_run(runner, [p])[0][0] for p in PROMPTS]
    together, sched = _run(runner, PROMPTS + PROMPTS[:2])  # the repeats hit the prefix cache
    assert together == alone + alone[:2]
    assert runner.blocks.hits > 0 and sched.preemptions == 0
    assert runner.blocks.num_used == 0


def test_random_loads_on_a_tiny_pool_always_finish(tiny_path: Path) -> None:
    """Random prompt mixes, pool sizes and token budgets: every generation completes and the pool ends empty.

    Seed 0's third case once failed: a sequence needing a block preempted one already scheduled in the same step.
    """
    import random

    base = load_runner(tiny_path, dtype="float32")
    per_token = kv_bytes_per_token(base.config, base.dtype)
    rng = random.Random(0)
    for _ in range(12):
        n, blocks, budget = rng.randint(4, 10), rng.randint(6, 16), rng.choice([16, 32, 48, 64, 128])
        prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(5, 70))] for _ in range(n)]
        runner = load_runner(tiny_path, dtype="float32", kv_cache_memory=per_token * 16 * blocks, prefix_caching=False)
        outputs, _ = _run(runner, prompts, max_batched_tokens=budget)
        assert all(len(t) == MAX_TOKENS for t in outputs)
        assert runner.blocks.num_used == 0


def test_random_loads_with_shared_prefixes_always_finish(tiny_path: Path) -> None:
    """As above with the prefix cache on and prompts sharing long prefixes, so waiting sequences hold matched
    blocks when preemption puts others back ahead of them.

    Seed 0 once failed: with nothing running, the head of the queue could not fit because sequences waiting
    behind it held their matched prefix blocks ("the KV cache cannot hold even one sequence").
    """
    import random

    base = load_runner(tiny_path, dtype="float32")
    per_token = kv_bytes_per_token(base.config, base.dtype)
    rng = random.Random(0)
    shared = [rng.randrange(3, 300) for _ in range(64)]
    for _ in range(12):
        n, blocks, budget = rng.randint(4, 10), rng.randint(7, 16), rng.choice([16, 32, 48, 64, 128])
        prompts = [shared[:rng.randint(16, 64)] + [rng.randrange(3, 300) for _ in range(rng.randint(1, 20))]
                   for _ in range(n)]
        prompts = [p[:blocks * 16 - MAX_TOKENS] for p in prompts]  # each fits the pool alone
        runner = load_runner(tiny_path, dtype="float32", kv_cache_memory=per_token * 16 * blocks)
        outputs, _ = _run(runner, prompts, max_batched_tokens=budget)
        assert all(len(t) == MAX_TOKENS for t in outputs)
        assert runner.blocks.num_used == 0


def test_a_worker_steps_on_its_share_of_the_cpu_threads(tiny_path: Path) -> None:
    """CPU workers split the cores (server/app.py): each sets its own intra-op threads on its own thread."""
    import torch

    from server.worker import Worker

    runner = load_runner(tiny_path, dtype="float32")
    seen: list[int] = []
    step = runner.step

    def recording_step(rows):
        seen.append(torch.get_num_threads())
        return step(rows)

    runner.step = recording_step
    before = torch.get_num_threads()

    async def main() -> None:
        worker = Worker(runner, threads=1)
        worker.start()
        gen = Generation(prompt_ids=PROMPTS[0], params=SamplingParams(temperature=0), max_tokens=3, ignore_eos=True)
        worker.submit(gen)
        while not isinstance(await asyncio.wait_for(gen.events.get(), 30), GenerationDone):
            pass
        worker.stop()

    try:
        asyncio.run(main())
    finally:
        torch.set_num_threads(before)  # the worker's setting is also torch's default for new threads
    assert len(seen) == 3 and set(seen) == {1}
    assert torch.get_num_threads() == before
