"""Embedding jobs on the scheduler in-process: batched under the token budget, taking turns with generations,
waiting for KV blocks a decoder's generations hold, and failing alone when they crash or cannot fit."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from engine import load_runner
from engine.cache.kv_cache import kv_bytes_per_token
from server.scheduling.embedding_jobs import EmbeddingJob, EmbeddingsDone
from server.scheduling.generation import ChoiceDelta, Generation, GenerationDone, GenerationFailed
from server.sampling.params import SamplingParams
from server.scheduling.scheduler import Scheduler

INPUTS = [[101, *range(2000 + 7 * i, 2000 + 7 * i + 3 + 5 * i), 102] for i in range(8)]  # 5 to 40 tokens


@pytest.fixture(scope="module")
def minilm():
    return load_runner("all-minilm-l6-v2")


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support import tiny_models

    return tiny_models.build_tiny_model("qwen3", tmp_path_factory.mktemp("tiny")).gguf_path


def _events(job) -> list:
    out = []
    while not job.channel.empty():
        owner, event = job.channel.get_nowait()
        assert owner is job
        out.append(event)
    return out


def _drive(sched: Scheduler, max_steps: int = 3000, each_step=None) -> int:
    for steps in range(max_steps):
        if not sched.has_work():
            return steps
        sched.step()
        if each_step is not None:
            each_step(sched)
    raise AssertionError("the scheduler did not finish")


def test_jobs_are_batched_under_the_token_budget(minilm) -> None:
    """Three jobs' 12 inputs of 5 to 40 tokens under a 32-token budget: several jobs share steps, an input longer
    than the budget runs alone, and every vector equals the input embedded on its own."""
    alone = [minilm.embed([ids]) for ids in INPUTS]

    async def main():
        sched = Scheduler(minilm, max_batched_tokens=32, max_running=8)
        jobs = [EmbeddingJob(INPUTS[:3]), EmbeddingJob(INPUTS[3:8]), EmbeddingJob(INPUTS[:4])]
        for job in jobs:
            sched.add(job)
        batches = []
        real = minilm.embed
        minilm.embed = lambda batch, pooling=None: batches.append([len(x) for x in batch]) or real(batch, pooling)
        try:
            _drive(sched)
        finally:
            minilm.embed = real
        await asyncio.sleep(0)
        assert all(sum(b) <= 32 or len(b) == 1 for b in batches), batches
        assert [40] in batches and len(batches) < 12
        for job, indices in zip(jobs, (range(3), range(3, 8), range(4))):
            (done,) = _events(job)
            assert isinstance(done, EmbeddingsDone)
            assert done.prompt_tokens == sum(len(INPUTS[i]) for i in indices)
            torch.testing.assert_close(done.embeddings, torch.cat([alone[i] for i in indices]), rtol=0, atol=1e-6)

    asyncio.run(main())


def test_a_cancelled_job_is_dropped_and_a_crashed_step_fails_only_its_jobs(minilm) -> None:
    async def main():
        sched = Scheduler(minilm, max_batched_tokens=16, max_running=8)
        cancelled, crashed, later = EmbeddingJob(INPUTS[:2]), EmbeddingJob(INPUTS[2:3]), EmbeddingJob(INPUTS[:1])
        for job in (cancelled, crashed, later):
            sched.add(job)
        cancelled.cancel()
        real = minilm.embed
        minilm.embed = lambda batch, pooling=None: (_ for _ in ()).throw(RuntimeError("boom"))
        with pytest.raises(RuntimeError):
            sched.step()
        minilm.embed = real
        assert sched.fail_step(500, "internal error") == 1  # 15 tokens: the budget holds `crashed` only
        _drive(sched)
        await asyncio.sleep(0)
        assert _events(cancelled) == []
        assert [(type(e), e.status) for e in _events(crashed)] == [(GenerationFailed, 500)]
        assert isinstance(_events(later)[0], EmbeddingsDone)

    asyncio.run(main())


def _greedy(prompt: list[int], max_tokens: int = 24) -> Generation:
    return Generation(prompt_ids=prompt, params=SamplingParams(temperature=0), max_tokens=max_tokens,
                      ignore_eos=True)


def _tokens(events: list) -> list[int]:
    assert isinstance(events[-1], GenerationDone)
    return [t for e in events if isinstance(e, ChoiceDelta) for t in e.tokens]


def test_embeddings_and_generations_take_turns_on_a_decoder(tiny_path: Path) -> None:
    runner = load_runner(tiny_path, dtype="float32")
    prompt = [5, 40, 77, 12] * 4
    inputs = [[7 + i] * (3 + 4 * i) for i in range(6)]
    alone_vectors = runner.embed(inputs)

    async def main():
        sched = Scheduler(runner, max_batched_tokens=16, max_running=4)
        alone = _greedy(prompt)
        sched.add(alone)
        _drive(sched)
        gen, job = _greedy(prompt), EmbeddingJob(inputs)
        sched.add(gen)
        sched.add(job)
        kinds = []
        real_embed, real_step = runner.embed, runner.step
        runner.embed = lambda batch, pooling=None: kinds.append("embed") or real_embed(batch, pooling)
        runner.step = lambda rows, *feed: kinds.append("gen") or real_step(rows, *feed)
        try:
            _drive(sched)
        finally:
            runner.embed, runner.step = real_embed, real_step
        await asyncio.sleep(0)
        assert _tokens(_events(gen)) == _tokens(_events(alone))
        (done,) = _events(job)
        torch.testing.assert_close(done.embeddings, alone_vectors, rtol=0, atol=1e-5)
        assert kinds.count("embed") >= 3 and kinds[:6] == ["embed", "gen"] * 3  # one each, in turn
        assert runner.blocks.num_used == 0

    asyncio.run(main())


def test_a_decoder_job_waits_for_the_blocks_generations_hold(tiny_path: Path) -> None:
    """A 4-block pool: a generation of 2-3 blocks runs; a 3-block input waits until it finishes. With nothing
    running that could give blocks back, an input the pool cannot hold fails rather than waits forever."""
    per_token = kv_bytes_per_token(load_runner(tiny_path, dtype="float32").config, torch.float32)
    runner = load_runner(tiny_path, dtype="float32", kv_cache_memory=per_token * 64, prefix_caching=False)

    async def main():
        sched = Scheduler(runner, max_batched_tokens=64, max_running=4)
        gen, job = _greedy([5, 40, 77, 12] * 8, max_tokens=20), EmbeddingJob([[9] * 40])
        sched.add(gen)
        sched.step()  # the generation's prompt takes 2 blocks and grows into a third
        sched.add(job)
        waited = []
        _drive(sched, each_step=lambda s: waited.append(s.embeddings.has_work() and bool(s.running)))
        await asyncio.sleep(0)
        assert any(waited)
        assert isinstance(_events(gen)[-1], GenerationDone) and isinstance(_events(job)[0], EmbeddingsDone)
        held = runner.new_sequence([3] * 48, use_prefix_cache=False)  # 3 blocks held outside the scheduler
        runner.blocks.allocate(held, 48)
        stuck = EmbeddingJob([[9] * 30])
        sched.add(stuck)
        _drive(sched)
        await asyncio.sleep(0)
        assert [(type(e), e.status) for e in _events(stuck)] == [(GenerationFailed, 500)]
        runner.free_sequence(held)

    asyncio.run(main())
