"""The scheduler in-process on a tiny model and a tiny KV pool: batching, chunking and preemption keep outputs."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from engine import load_runner
from engine.cache.kv_cache import kv_bytes_per_token
from server.scheduling.generation import ChoiceDelta, Generation, GenerationDone
from server.sampling.params import SamplingParams
from server.scheduling.scheduler import Scheduler

PROMPTS = [[5 + i, 40 + 3 * i, 77, 12 + i] * (3 + i % 3) for i in range(6)]
MAX_TOKENS = 24


def _run(runner, prompts: list[list[int]], **scheduler_args) -> tuple[list[list[int]], Scheduler]:
    """Greedy generations for every prompt, all submitted at once; the tokens each one produced."""

    async def main() -> tuple[list[list[int]], Scheduler]:
        budget = scheduler_args.get("max_batched_tokens", 512)
        sched = Scheduler(runner, **{"max_running": min(32, budget), **scheduler_args})
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
            while not g.channel.empty():
                _, event = g.channel.get_nowait()
                if isinstance(event, ChoiceDelta):
                    tokens += event.tokens
                done = done or isinstance(event, GenerationDone)
            assert done
            out.append(tokens)
        return out, sched

    return asyncio.run(main())


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support import tiny_models

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
    """CPU workers split the cores (server/api/app.py): each sets its own intra-op threads on its own thread."""
    import torch

    from server.scheduling.worker import Worker

    runner = load_runner(tiny_path, dtype="float32")
    seen: list[int] = []
    step = runner.step

    def recording_step(rows, *feed):
        seen.append(torch.get_num_threads())
        return step(rows, *feed)

    runner.step = recording_step
    before = torch.get_num_threads()

    async def main() -> None:
        worker = Worker(runner, threads=1)
        worker.start()
        gen = Generation(prompt_ids=PROMPTS[0], params=SamplingParams(temperature=0), max_tokens=3, ignore_eos=True)
        worker.submit(gen)
        while not isinstance((await asyncio.wait_for(gen.channel.get(), 30))[1], GenerationDone):
            pass
        worker.stop()

    try:
        asyncio.run(main())
    finally:
        torch.set_num_threads(before)  # the worker's setting is also torch's default for new threads
    assert len(seen) == 3 and set(seen) == {1}
    assert torch.get_num_threads() == before


# ---------------------------------------------------------------------------------------------------
# faults stay with their request; forks, the running cap and the token budget (issue 12)


def _events(gen: Generation) -> list:
    out = []
    while not gen.channel.empty():
        owner, event = gen.channel.get_nowait()
        assert owner is gen
        out.append(event)
    return out


def _choices(events: list, n: int) -> list[list[int]]:
    tokens: list[list[int]] = [[] for _ in range(n)]
    for e in events:
        if isinstance(e, ChoiceDelta):
            tokens[e.index] += e.tokens
    return tokens


def _drive(sched: Scheduler, max_steps: int = 3000, each_step=None) -> None:
    for _ in range(max_steps):
        if not sched.has_work():
            return
        sched.step()
        if each_step is not None:
            each_step(sched)
    raise AssertionError("the scheduler did not finish")


def _greedy(prompt: list[int], max_tokens: int = MAX_TOKENS, **kw) -> Generation:
    return Generation(prompt_ids=prompt, params=SamplingParams(temperature=0), max_tokens=max_tokens,
                      ignore_eos=True, **kw)


def test_a_row_past_the_context_fails_only_its_own_request(tiny_path: Path) -> None:
    """A sequence that outgrows the context (here: a generation let past the serving layer's check) gets a 400;
    the requests sharing its steps finish with exactly what they get alone."""
    from server.scheduling.generation import GenerationFailed

    runner = load_runner(tiny_path, dtype="float32", max_context=64)
    alone = [_run(runner, [p])[0][0] for p in PROMPTS[:3]]

    async def main():
        sched = Scheduler(runner)
        ok = [_greedy(p) for p in PROMPTS[:3]]
        bad = _greedy(PROMPTS[3], max_tokens=64)  # 16 + 64 tokens > 64
        for g in ok[:1] + [bad] + ok[1:]:
            sched.add(g)
        _drive(sched)
        await asyncio.sleep(0)
        failed = [e for e in _events(bad) if isinstance(e, GenerationFailed)]
        assert len(failed) == 1 and failed[0].status == 400 and failed[0].code == "context_length_exceeded"
        assert "exceeds the context size of 64" in failed[0].message
        for g, expected in zip(ok, alone):
            events = _events(g)
            assert isinstance(events[-1], GenerationDone)
            assert _choices(events, 1)[0] == expected
        assert runner.blocks.num_used == 0

    asyncio.run(main())


def test_a_crashed_step_fails_only_the_requests_in_it(tiny_path: Path) -> None:
    """fail_step after a crash: the step's generations get the error; a waiting one is untouched and finishes."""
    from server.scheduling.generation import GenerationFailed

    runner = load_runner(tiny_path, dtype="float32")
    expected = _run(runner, [PROMPTS[2]])[0][0]

    async def main():
        sched = Scheduler(runner, max_running=2)
        first, second, third = (_greedy(p) for p in PROMPTS[:3])
        for g in (first, second, third):
            sched.add(g)
        real = runner.step
        runner.step = lambda rows, *feed: (_ for _ in ()).throw(RuntimeError("boom"))
        with pytest.raises(RuntimeError):
            sched.step()
        assert sched.fail_step(500, "internal error") == 2  # first and second ran in it; third waited
        runner.step = real
        _drive(sched)
        await asyncio.sleep(0)
        for g in (first, second):
            assert [type(e) for e in _events(g)] == [GenerationFailed]
        events = _events(third)
        assert isinstance(events[-1], GenerationDone) and _choices(events, 1)[0] == expected
        assert runner.blocks.num_used == 0

    asyncio.run(main())


def test_forked_choices_on_a_full_pool_preempt_rather_than_fail(tiny_path: Path) -> None:
    """n > 1: the choices share the prompt's partial last block, and each one's first write copies it. The copy
    is counted when blocks are checked, so a nearly full pool preempts (or waits) instead of raising."""
    base = load_runner(tiny_path, dtype="float32")
    per_token = kv_bytes_per_token(base.config, base.dtype)
    prompt = PROMPTS[1][:18]  # 2 blocks, the second partial
    alone = _run(base, [prompt])[0][0]

    async def main():
        runner = load_runner(tiny_path, dtype="float32", kv_cache_memory=per_token * 16 * 5, prefix_caching=False)
        sched = Scheduler(runner, max_batched_tokens=64, max_running=32)
        gen = Generation(prompt_ids=prompt, params=SamplingParams(temperature=0), max_tokens=MAX_TOKENS,
                         ignore_eos=True, n=4)
        sched.add(gen)
        _drive(sched)
        await asyncio.sleep(0)
        events = _events(gen)
        assert isinstance(events[-1], GenerationDone), events[-1]
        assert _choices(events, 4) == [alone] * 4
        assert sched.preemptions > 0  # 4 choices x 3 blocks do not fit in 5 blocks
        assert runner.blocks.num_used == 0

    asyncio.run(main())


def test_forked_choices_count_against_max_running(tiny_path: Path) -> None:
    runner = load_runner(tiny_path, dtype="float32")
    alone = _run(runner, [PROMPTS[0]])[0][0]
    seen: list[int] = []

    async def main():
        sched = Scheduler(runner, max_running=3)
        gens = [Generation(prompt_ids=PROMPTS[0], params=SamplingParams(temperature=0), max_tokens=MAX_TOKENS,
                           ignore_eos=True, n=5), _greedy(PROMPTS[1])]
        for g in gens:
            sched.add(g)
        _drive(sched, each_step=lambda s: seen.append(len(s.running)))
        await asyncio.sleep(0)
        events = _events(gens[0])
        assert isinstance(events[-1], GenerationDone) and _choices(events, 5) == [alone] * 5
        assert isinstance(_events(gens[1])[-1], GenerationDone)
        assert runner.blocks.num_used == 0

    asyncio.run(main())
    assert max(seen) == 3, seen


def test_a_token_budget_below_the_batch_is_refused(tiny_path: Path) -> None:
    """With fewer tokens per step than running sequences, the sequences past the budget would wait behind the
    others (and prompts behind all of them): refused, as vLLM refuses max_num_batched_tokens < max_num_seqs."""
    runner = load_runner(tiny_path, dtype="float32")
    with pytest.raises(ValueError, match=r"max_batched_tokens \(2\) must be at least max_running \(8\)"):
        Scheduler(runner, max_batched_tokens=2, max_running=8)
    Scheduler(runner, max_batched_tokens=8, max_running=8)


def test_echo_logprobs_cover_every_prompt_token_whatever_the_chunking(tiny_path: Path) -> None:
    """Prompt logprobs with the prompt prefilled in chunks of 7: one entry per prompt token, the first None, each
    the log-softmax of the logits after the tokens before it (the whole prompt in one pass as reference)."""
    import torch

    from server.scheduling.generation import PromptLogprobs

    runner = load_runner(tiny_path, dtype="float32")
    prompt = [t for p in PROMPTS for t in p][:61]
    reference = torch.log_softmax(runner.predict_logits(prompt).float(), -1)

    async def main():
        for budget in (7, 16, 512):
            sched = Scheduler(runner, max_batched_tokens=budget, max_running=min(budget, 32))
            gen = Generation(prompt_ids=prompt, params=SamplingParams(temperature=0), max_tokens=1,
                             ignore_eos=True, prompt_logprobs=2)
            sched.add(gen)
            _drive(sched)
            await asyncio.sleep(0)
            entries = next(e for e in _events(gen) if isinstance(e, PromptLogprobs)).entries
            assert len(entries) == len(prompt) and entries[0] is None
            for i, entry in enumerate(entries[1:], 1):
                assert entry.token == prompt[i]
                assert abs(entry.logprob - reference[i - 1, prompt[i]].item()) < 1e-4, (budget, i)
                top = reference[i - 1].topk(2)
                assert [t for t, _ in entry.top] == top.indices.tolist()

    asyncio.run(main())


# ---------------------------------------------------------------------------------------------------
# grammar-constrained choices (issue 14): the mask holds on every constrained row of a mixed batch, through
# forks and preemption, and the other rows are untouched


@pytest.mark.parametrize("variant", ["llama_tied", "llama3_scaled", "qwen2", "qwen3", "gemma3"])
def test_grammar_rows_of_a_mixed_batch_match_and_the_rest_are_untouched(tmp_path: Path, variant: str) -> None:
    import re

    from tests.support import tiny_models

    from server.grammar.compiler import GrammarCompiler, GrammarSpec

    path = tiny_models.build_tiny_model(variant, tmp_path).gguf_path
    base = load_runner(path, dtype="float32")
    per_token = kv_bytes_per_token(base.config, base.dtype)
    free_prompts = [PROMPTS[0][:18], PROMPTS[3][:18]]
    alone = [_run(base, [p])[0][0] for p in free_prompts]
    regex = r"[a-e]{2,5}( [a-e]{2,5}){0,3}"

    async def main():
        runner = load_runner(path, dtype="float32", kv_cache_memory=per_token * 16 * 6, prefix_caching=False)
        grammar = GrammarCompiler(runner.tokenizer).compile(GrammarSpec("regex", regex))
        sched = Scheduler(runner, max_batched_tokens=64, max_running=32)
        constrained = [Generation(prompt_ids=PROMPTS[i][:18], params=SamplingParams(temperature=1.0, seed=i),
                                  max_tokens=40, n=2, grammar=grammar, stop_token_ids=runner.tokenizer.end_token_ids)
                       for i in (1, 2)]
        free = [_greedy(p) for p in free_prompts]
        for gen in [constrained[0], free[0], constrained[1], free[1]]:
            sched.add(gen)
        _drive(sched)
        await asyncio.sleep(0)
        for gen in constrained:
            events = _events(gen)
            assert isinstance(events[-1], GenerationDone)
            for index in range(2):
                deltas = [e for e in events if isinstance(e, ChoiceDelta) and e.index == index]
                text = "".join(e.text for e in deltas)
                assert deltas[-1].finish_reason == "stop" and re.fullmatch(regex, text), text
        assert [_choices(_events(g), 1)[0] for g in free] == alone
        assert sched.preemptions > 0
        assert runner.blocks.num_used == 0

    asyncio.run(main())


def _events(gen: Generation) -> list:
    out = []
    while not gen.channel.empty():
        out.append(gen.channel.get_nowait()[1])
    return out


def test_a_stream_interval_gathers_tokens_into_fewer_events(tiny_path: Path) -> None:
    """Interval 4: each choice's first token alone, then four at a time, the rest with the finish; the text, tokens
    and logprobs the same as one event per token. A generation failed mid-way still hands on what it held."""
    runner = load_runner(tiny_path, dtype="float32")
    params = SamplingParams(temperature=0, logprobs=True, top_logprobs=2)

    async def main() -> None:
        sched = Scheduler(runner)
        gens = {interval: Generation(prompt_ids=PROMPTS[0], params=params, max_tokens=10, n=2, ignore_eos=True,
                                     stream_interval=interval) for interval in (1, 4)}
        for gen in gens.values():
            sched.add(gen)
        while sched.has_work():
            sched.step()
        await asyncio.sleep(0)
        per_choice = {}
        for interval, gen in gens.items():
            deltas = [e for e in _events(gen) if isinstance(e, ChoiceDelta)]
            for choice in (0, 1):
                mine = [d for d in deltas if d.index == choice]
                per_choice[interval, choice] = mine
                assert [d.finish_reason for d in mine][-1] == "length"
                assert all(d.finish_reason is None for d in mine[:-1])
        for choice in (0, 1):
            assert [len(d.tokens) for d in per_choice[1, choice]] == [1] * 10
            assert [len(d.tokens) for d in per_choice[4, choice]] == [1, 4, 4, 1]
            for field in ("tokens", "logprobs"):
                one, four = ([x for d in per_choice[i, choice] for x in getattr(d, field)] for i in (1, 4))
                assert one == four and len(one) == 10
            assert "".join(d.text for d in per_choice[1, choice]) == "".join(d.text for d in per_choice[4, choice])

        failing = Generation(prompt_ids=PROMPTS[1], params=params, max_tokens=50, ignore_eos=True, stream_interval=8)
        sched.add(failing)
        for _ in range(5):  # the prompt's step and four decode steps: five tokens, four of them held
            sched.step()
        sched.fail([failing], 500, "boom")
        await asyncio.sleep(0)
        events = _events(failing)
        assert [len(e.tokens) for e in events if isinstance(e, ChoiceDelta)] == [1, 4]
        assert type(events[-1]).__name__ == "GenerationFailed"
        assert runner.blocks.num_used == 0

    asyncio.run(main())


def test_stream_interval_zero_follows_the_load(tiny_path: Path) -> None:
    """Left to the scheduler (0), chunks gather one token more per 16 running sequences: 48 together, 3 a chunk;
    one alone, every token on its own."""
    from server.scheduling.scheduler import AUTO_MAX_INTERVAL, AUTO_STREAMS, auto_stream_interval

    for running in range(1, 1000):
        assert auto_stream_interval(running) == max(1, min(AUTO_MAX_INTERVAL, running // AUTO_STREAMS))
    probe = load_runner(tiny_path, dtype="float32")
    runner = load_runner(tiny_path, dtype="float32",  # a pool that holds all 48 sequences at once
                         kv_cache_memory=kv_bytes_per_token(probe.config, probe.dtype) * 48 * 64)

    async def main(count: int) -> list[list[int]]:
        sched = Scheduler(runner, max_running=64)
        gens = [Generation(prompt_ids=PROMPTS[i % 6], params=SamplingParams(temperature=0), max_tokens=10,
                           ignore_eos=True, stream_interval=0) for i in range(count)]
        for gen in gens:
            sched.add(gen)
        while sched.has_work():
            sched.step()
        await asyncio.sleep(0)
        return [[len(e.tokens) for e in _events(g) if isinstance(e, ChoiceDelta)] for g in gens]

    sizes = asyncio.run(main(48))
    assert all(s == [1, 3, 3, 3] for s in sizes), [s for s in sizes if s != [1, 3, 3, 3]][:3]
    assert asyncio.run(main(1)) == [[1] * 10]


def _outcomes(runner, requests: list[dict], defer: bool, async_scheduling: bool = False) -> list[tuple]:
    """Each request run as a Generation beside the others: per choice its tokens, text, finish and stop reasons and
    logprobs, then the usage; with the text of each token deferred (Scheduler.defer_text) or not, and the next step
    launched before the host has a greedy step's tokens (Scheduler.async_scheduling) or not."""

    async def main() -> list[tuple]:
        sched = Scheduler(runner, max_batched_tokens=48, max_running=8, defer_text=defer,
                          async_scheduling=async_scheduling)
        assert sched.async_scheduling == async_scheduling
        gens = [Generation(**r) for r in requests]
        for g in gens:
            sched.add(g)
        _drive(sched)
        await asyncio.sleep(0)
        out = []
        for g in gens:
            events = _events(g)
            choices = []
            for i in range(g.n):
                mine = [e for e in events if isinstance(e, ChoiceDelta) and e.index == i]
                choices.append(([t for d in mine for t in d.tokens], "".join(d.text for d in mine),
                                mine[-1].finish_reason, mine[-1].stop_reason,
                                [lp for d in mine for lp in (d.logprobs or [])]))
            done = [e for e in events if isinstance(e, GenerationDone)]
            out.append((choices, done))
        assert runner.blocks.num_used == 0
        return out

    return asyncio.run(main())


def _feeding(runner) -> list[int]:
    """Counts, as the scheduler runs, the steps of `runner` that read tokens on the device (engine.model.batch.TokenFeed):
    [steps, fed rows]."""
    counts, step = [0, 0], runner.step

    def counted(rows, feed=None):
        if feed is not None:
            counts[0] += 1
            counts[1] += sum(s >= 0 for s in feed.sources)
            return step(rows, feed)
        return step(rows)

    runner.step = counted
    return counts


def _assert_same_outcomes(plain: list[tuple], other: list[tuple]) -> None:
    """Exact but for the logprobs, whose rows a different preemption (blocks are freed a step later) may have
    recomputed through a prompt chunk rather than decode steps: float32 apart by rounding."""
    strip = [([c[:4] for c in choices], done) for choices, done in plain]
    assert [([c[:4] for c in choices], done) for choices, done in other] == strip
    for (choices, _), (again, _) in zip(plain, other):
        for c, d in zip(choices, again):
            assert [t.token for t in c[4]] == [t.token for t in d[4]]
            assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(c[4], d[4]))


def test_deferred_text_and_async_scheduling_change_no_output(tiny_path: Path) -> None:
    """With each token's text, stops and event handed on only once the next step is launched (defer_text, the
    default on a GPU), and with async scheduling (`--async-scheduling`: a plain greedy step's tokens stay on the
    device, the next step is launched reading them there, and the host takes them afterwards), every generation
    gets what it gets without: the same tokens, text, finish and stop reasons, logprobs and usage, on a pool small
    enough to preempt. Stop strings and an end token cut from a plain run's own outputs end generations mid-way (a
    stop found late has cost its unit a row, dropped); seeded sampled rows (n = 2, logprobs) and min_tokens run
    beside the greedy ones; nothing is left held."""
    base = load_runner(tiny_path, dtype="float32")
    per_token = kv_bytes_per_token(base.config, base.dtype)
    runner = load_runner(tiny_path, dtype="float32", kv_cache_memory=per_token * 16 * 10, prefix_caching=False)
    greedy, sampled = SamplingParams(temperature=0), SamplingParams(temperature=0.9, seed=3, logprobs=True,
                                                                    top_logprobs=2)
    requests = [dict(prompt_ids=PROMPTS[i], params=greedy, max_tokens=30 - i, ignore_eos=True) for i in range(4)]
    requests += [dict(prompt_ids=PROMPTS[4], params=sampled, max_tokens=20, n=2, ignore_eos=True, stream_interval=3),
                 dict(prompt_ids=PROMPTS[5], params=greedy, max_tokens=1, ignore_eos=True)]
    plain = _outcomes(runner, requests, defer=False)
    text0, tokens1, text2 = plain[0][0][0][1], plain[1][0][0][0], plain[2][0][0][1]
    assert len(text0) >= 12 and len(text2) >= 12
    requests[0]["stop"] = [text0[len(text0) // 2:len(text0) // 2 + 3]]
    requests[1].update(ignore_eos=False, stop_token_ids=frozenset({tokens1[12]}))
    requests[2].update(stop=[text2[2:5]], min_tokens=6)  # maybe inside the first 6 tokens: then plain text
    plain = _outcomes(runner, requests, defer=False)
    assert plain[0][0][0][2:4] == ("stop", requests[0]["stop"][0]) and len(plain[0][0][0][0]) < 30
    assert plain[1][0][0][2] == "stop" and len(plain[1][0][0][0]) <= 13
    _assert_same_outcomes(plain, _outcomes(runner, requests, defer=True))
    fed = _feeding(runner)
    for defer in (False, True):
        _assert_same_outcomes(plain, _outcomes(runner, requests, defer=defer, async_scheduling=True))
    assert fed[0] > 10 and fed[1] > 30, fed  # the steps of greedy rows only read their tokens on the device


def test_async_scheduling_caches_generated_blocks(tiny_path: Path) -> None:
    """A block that held a token still on its way (async scheduling) enters the prefix cache once the token is
    known: a second turn continuing each first turn's output reuses as many cached tokens as without async
    scheduling, more than the first turn's prompt."""
    greedy = SamplingParams(temperature=0)

    def turns(async_scheduling: bool) -> tuple[list[tuple], list[tuple]]:
        runner = load_runner(tiny_path, dtype="float32")
        first = [dict(prompt_ids=PROMPTS[i], params=greedy, max_tokens=40, ignore_eos=True) for i in range(3)]
        one = _outcomes(runner, first, defer=False, async_scheduling=async_scheduling)
        second = [dict(prompt_ids=PROMPTS[i] + choices[0][0] + [7, 8], params=greedy, max_tokens=4, ignore_eos=True)
                  for i, (choices, _) in enumerate(one)]
        return one, _outcomes(runner, second, defer=False, async_scheduling=async_scheduling)

    plain, fed = turns(False), turns(True)
    assert fed == plain
    for (_, done), prompt in zip(fed[1], PROMPTS):
        assert done[0].cached_tokens > len(prompt) + 16, (done[0], len(prompt))
