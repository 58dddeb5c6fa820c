"""Speculative decoding through the scheduler on the tiny random models: greedy outputs identical to decoding
without it (prompt lookup on every family, a draft model that always agrees and one that rarely does), with `n`,
stops, logprobs, preemption and the prefix cache; and the adaptive rule on constructed acceptance."""
from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from engine import Runner, load_runner
from engine.cache.kv_cache import kv_bytes_per_token
from server.scheduling.loading import load_speculator
from server.speculative.draft_model import DraftModel, vocabulary_mismatch
from server.scheduling.generation import ChoiceDelta, Generation, GenerationDone
from server.scheduling.progress import LoadProgress
from server.sampling.params import SamplingParams
from server.sampling.sampler import SequenceSampler
from server.scheduling.scheduler import Scheduler
from server.config.settings import Settings
from server.speculative.speculator import (FIRST_PAUSE, PAUSE_BELOW, PROBE_RATE, RATE_WEIGHT, SpeculativeConfig,
    Speculator)
from server.speculative.cost import EXPLORE_EVERY, PROBE_EVERY, StepCost
from tests.support import tiny_models

# Copy-heavy prompts: a phrase repeated, so prompt lookup has matches from the first step.
PROMPTS = [[5 + i, 40 + 3 * i, 77, 12 + i, 90, 31 + i] * 4 + [5 + i, 40 + 3 * i] for i in range(4)]


@dataclass
class Choice:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish: str | None = None
    logprobs: list = field(default_factory=list)


def generate(runner: Runner, requests: list[dict], speculator: Speculator | None = None,
             **scheduler_args) -> tuple[list[list[Choice]], Scheduler]:
    """Every request (Generation fields over greedy, 32 tokens, ignore_eos) submitted at once; each one's
    choices."""

    async def main() -> tuple[list[list[Choice]], Scheduler]:
        sched = Scheduler(runner, speculator=speculator, **{"max_running": 16, **scheduler_args})
        gens = [Generation(**{"prompt_ids": PROMPTS[0], "params": SamplingParams(temperature=0), "max_tokens": 32,
                              "ignore_eos": True, **r}) for r in requests]
        for g in gens:
            sched.add(g)
        for _ in range(3000):
            if not sched.has_work():
                break
            sched.step()
        assert not sched.has_work()
        await asyncio.sleep(0)
        out = []
        for g in gens:
            choices, done = [Choice() for _ in range(g.n)], False
            while not g.channel.empty():
                _, event = g.channel.get_nowait()
                if isinstance(event, ChoiceDelta):
                    c = choices[event.index]
                    c.tokens += event.tokens
                    c.text += event.text
                    c.finish = event.finish_reason or c.finish
                    c.logprobs += event.logprobs or []
                done = done or isinstance(event, GenerationDone)
            assert done
            out.append(choices)
        return out, sched

    return asyncio.run(main())


def ngram(k: int = 4, **kw) -> Speculator:
    return Speculator(SpeculativeConfig("ngram", k, **kw))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from a second thread, and on a shared machine their OpenMP barriers can cost many
    times their work (bench/RESULTS.md#issue-32-tiny-model-threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("tiny")
    built: dict[str, Path] = {}

    def path(variant: str) -> Path:
        if variant not in built:
            built[variant] = tiny_models.build_tiny_model(variant, root).gguf_path
        return built[variant]

    return path


GREEDY = SequenceSampler(SamplingParams(temperature=0), tiny_models.VOCAB_SIZE, [])
REQUESTS = [{"prompt_ids": p} for p in PROMPTS] + [{"prompt_ids": PROMPTS[1], "n": 2, "max_tokens": 20}]


@pytest.mark.parametrize("variant", tiny_models.VARIANTS)
def test_prompt_lookup_keeps_greedy_outputs_on_every_family(tiny, variant: str) -> None:
    runner = load_runner(tiny(variant), dtype="float32")
    plain, _ = generate(runner, REQUESTS)
    spec = ngram()
    fast, _ = generate(runner, REQUESTS, spec)
    assert [[c.tokens for c in g] for g in fast] == [[c.tokens for c in g] for g in plain]
    assert all(len(c.tokens) == r.get("max_tokens", 32) for g, r in zip(fast, REQUESTS) for c in g)
    assert spec.stats.num_drafts > 0 and spec.stats.num_draft_tokens >= spec.stats.num_drafts
    assert spec.stats.num_accepted_tokens > 0
    assert runner.blocks.num_used == 0
    sequences = [r["prompt_ids"] + c.tokens for g, r in zip(fast, REQUESTS) for c in g]
    assert _cached_blocks_hold_real_tokens(runner, sequences)


def _cached_blocks_hold_real_tokens(runner: Runner, sequences: list[list[int]]) -> bool:
    """Every block in the prefix cache holds tokens some real sequence has at that block (never rejected drafts)."""
    bs = runner.blocks.block_size
    real = {tuple(s[i:i + bs]) for s in sequences for i in range(0, len(s) - bs + 1, bs)}
    return set(runner.blocks._tokens_of.values()) <= real


@pytest.mark.parametrize("draft_variant", ["qwen3", "qwen2"])
def test_a_draft_model_keeps_greedy_outputs_under_preemption(tiny, draft_variant: str) -> None:
    """qwen3 drafting for itself agrees on every token (every draft accepted); random qwen2 weights rarely do (most
    rejected). Either way the outputs are the target's, on a pool so small that sequences are preempted."""
    roomy = load_runner(tiny("qwen3"), dtype="float32")
    plain, _ = generate(roomy, REQUESTS)
    per_token = kv_bytes_per_token(roomy.config, roomy.dtype)
    tight = load_runner(tiny("qwen3"), dtype="float32", kv_cache_memory=per_token * 128, prefix_caching=False)
    draft = load_runner(tiny(draft_variant), dtype="float32")
    assert vocabulary_mismatch(tight, draft) is None
    spec = Speculator(SpeculativeConfig("draft", 3), DraftModel(draft))
    fast, sched = generate(tight, REQUESTS, spec, max_batched_tokens=16)
    assert [[c.tokens for c in g] for g in fast] == [[c.tokens for c in g] for g in plain]
    assert sched.preemptions > 0
    stats = spec.stats
    assert stats.num_drafts > 0
    if draft_variant == "qwen3":
        assert stats.num_accepted_tokens == stats.num_draft_tokens
        assert stats.accepted_per_position[0] == stats.num_drafts
    else:
        assert stats.num_accepted_tokens < stats.num_draft_tokens / 2
    assert tight.blocks.num_used == 0
    spec.retain(())  # the draft's sequences go with their rows
    assert draft.blocks.num_used == 0


def test_greedy_drafts_chained_on_the_device_are_the_drafts_argmax_continuations(tiny) -> None:
    """Rows of different k in one call (their passes reading the previous picks on the device) draft exactly what
    the draft model decodes greedily from each row's tokens; a second call after some tokens were accepted
    continues from the cache, and the prefix cache holds only real tokens (the placeholders were filled in)."""
    draft = load_runner(tiny("qwen3"), dtype="float32")
    bs = draft.blocks.block_size
    rows = [(object(), list(range(3, 3 + bs - 2)), 5), (object(), list(range(7, 7 + 2 * bs)), 3),
            (object(), list(range(9, 20)), 1)]
    model = DraftModel(draft)
    got = model.propose([(key, tokens, k, GREEDY) for key, tokens, k in rows])
    for key, tokens, k in rows:
        assert got[key].tokens == draft.generate(tokens, k), k
        assert got[key].probs is None
    later = [(key, tokens + got[key].tokens[:2] + [5], 4) for key, tokens, _ in rows]
    again = model.propose([(key, tokens, k, GREEDY) for key, tokens, k in later])
    for key, tokens, k in later:
        assert again[key].tokens == draft.generate(tokens, k)
    assert _cached_blocks_hold_real_tokens(draft, [t + again[key].tokens for key, t, _ in later])
    model.retain(())
    draft.reset_session()  # generate's own sequence
    assert draft.blocks.num_used == 0


def test_stops_max_tokens_and_logprobs_inside_accepted_tokens(tiny) -> None:
    runner = load_runner(tiny("llama_tied"), dtype="float32")
    base = {"prompt_ids": PROMPTS[2], "params": SamplingParams(temperature=0, logprobs=True, top_logprobs=2)}
    (reference,), _ = generate(runner, [base])
    text = reference[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    start = text.index(stop)
    requests = [base, base | {"stop": [stop]}, base | {"max_tokens": 7}]
    plain, _ = generate(runner, requests)
    spec = ngram()
    fast, _ = generate(runner, requests, spec)
    assert spec.stats.num_accepted_tokens > 0
    for p, f in zip(plain, fast):
        assert (f[0].tokens, f[0].text, f[0].finish) == (p[0].tokens, p[0].text, p[0].finish)
        assert len(f[0].logprobs) == len(f[0].tokens)
        for a, b in zip(f[0].logprobs, p[0].logprobs):  # the target's logprobs, whichever way a token came
            assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert fast[1][0].finish == "stop" and fast[1][0].text == text[:start]
    assert fast[2][0].finish == "length" and len(fast[2][0].tokens) == 7


def test_sampled_rows_speculate_and_a_seed_repeats(tiny) -> None:
    runner = load_runner(tiny("qwen2"), dtype="float32")
    params = SamplingParams(temperature=0.8, top_p=0.95, frequency_penalty=0.3, seed=4)
    requests = [{"prompt_ids": p, "params": params, "n": 2} for p in PROMPTS[:2]]
    spec = ngram()
    first, _ = generate(runner, requests, spec)
    again, _ = generate(runner, requests, ngram())
    assert spec.stats.num_drafts > 0
    assert [[c.tokens for c in g] for g in first] == [[c.tokens for c in g] for g in again]
    assert all(len(c.tokens) == 32 and all(0 <= t < runner.vocab_size for t in c.tokens) for g in first for c in g)
    assert runner.blocks.num_used == 0


def test_a_draft_model_samples_its_drafts_as_the_row_samples(tiny) -> None:
    """A sampled row drafts from the draft's distribution processed by the row's own sampler: with the target as
    its own draft, that is the target's distribution, so nearly every draft is accepted (min(1, p/q) = 1 but for
    rounding) even at a high temperature with penalties and top-p."""
    target = load_runner(tiny("llama_tied"), dtype="float32")
    draft = load_runner(tiny("llama_tied"), dtype="float32")
    params = SamplingParams(temperature=1.5, top_p=0.9, presence_penalty=0.5, logit_bias={7: 2.0}, seed=9)
    spec = Speculator(SpeculativeConfig("draft", 4), DraftModel(draft))
    out, _ = generate(target, [{"prompt_ids": p, "params": params} for p in PROMPTS[:3]], spec)
    assert all(len(g[0].tokens) == 32 for g in out)
    assert spec.stats.num_draft_tokens > 30
    assert spec.stats.num_accepted_tokens >= 0.9 * spec.stats.num_draft_tokens
    # Each sampled draft comes with the distribution it was drawn from, in which it has weight.
    direct = Speculator(SpeculativeConfig("draft", 4), DraftModel(draft))
    for i, p in enumerate(PROMPTS[:3]):
        sampler = SequenceSampler(params, target.vocab_size, p)
        proposal = direct.draft.propose([(i, p, 4, sampler)])[i]
        assert proposal.probs is not None and proposal.probs.shape == (4, target.vocab_size)
        assert all(proposal.probs[j, t] > 0 for j, t in enumerate(proposal.tokens))
    direct.retain(())
    spec.retain(())
    assert draft.blocks.num_used == 0



def test_a_step_where_no_row_drafts_keeps_the_drafts_cache(tiny, caplog: pytest.LogCaptureFixture) -> None:
    """A step in which every row sits out (paused, or a step that measures the plain cost) runs no draft pass: the
    draft does not fail, and its sequences stay, so the row's next draft continues from its cache."""
    draft = load_runner(tiny("qwen3"), dtype="float32")
    spec, key = Speculator(SpeculativeConfig("draft", 4, measure=False), DraftModel(draft)), object()
    rows = [(key, PROMPTS[0], 4, GREEDY)]
    assert len(spec.propose(rows)[key].tokens) == 4
    used = draft.blocks.num_used
    assert used > 0
    assert spec.draft.propose([]) == {}
    for _ in range(4):  # rate 1 -> 0.7 -> 0.49 -> 0.34 -> 0.24: below PAUSE_BELOW, the row pauses
        spec.record(key, 4, 0)
    with caplog.at_level("DEBUG", logger="emberserve"):
        assert spec.propose(rows) == {}
    assert not [r for r in caplog.records if r.levelname in ("WARNING", "ERROR")]
    assert draft.blocks.num_used == used
    spec.retain(())
    assert draft.blocks.num_used == 0

def test_the_rate_shortens_drafts_then_pauses_a_row_that_keeps_failing() -> None:
    """Each rejected step lowers the moving rate by RATE_WEIGHT; drafts are ceil(K x rate) long, and below
    PAUSE_BELOW the row sits out FIRST_PAUSE steps, then probes again at PROBE_RATE."""
    spec, row = ngram(4, measure=False), object()
    tokens = [1, 2, 3, 4, 5, 6, 7, 8] * 6
    rows = [(row, tokens, 16, GREEDY)]
    rate, lengths = 1.0, []
    while rate >= PAUSE_BELOW:
        drafts = spec.propose(rows)[row].tokens
        assert len(drafts) == max(1, math.ceil(4 * rate))
        lengths.append(len(drafts))
        spec.record(row, len(drafts), 0)
        rate += RATE_WEIGHT * (0 - rate)
    assert lengths[0] == 4 and lengths[-1] < 4
    for _ in range(FIRST_PAUSE):
        assert spec.propose(rows) == {}
    assert len(spec.propose(rows)[row].tokens) == math.ceil(4 * PROBE_RATE)
    assert spec.stats.num_drafts == len(lengths) and spec.stats.num_accepted_tokens == 0
    assert spec.stats.num_draft_tokens == sum(lengths)


def test_acceptance_is_counted_by_position_and_big_batches_can_turn_it_off() -> None:
    spec = ngram(4, disable_by_batch_size=2, measure=False)
    rows = [(object(), [1, 2, 3, 1, 2], 4, GREEDY) for _ in range(3)]
    assert spec.propose(rows) == {}
    proposals = spec.propose(rows[:2])
    assert [p.tokens for p in proposals.values()] == [[3, 1, 2, 3]] * 2  # what followed [1, 2], repeating
    assert all(p.probs is None for p in proposals.values())
    spec.record(rows[0][0], 3, 2)
    spec.record(rows[1][0], 3, 0)
    s = spec.stats
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, s.accepted_per_position) == (2, 6, 2,
                                                                                                 [1, 1, 0, 0])


def test_a_draft_of_another_vocabulary_is_refused_at_start_up(tiny) -> None:
    target = load_runner(tiny("qwen3"), dtype="float32")
    settings = Settings(model=str(tiny("qwen3")), draft_model=str(tiny("gemma3")), dtype="float32")
    with pytest.raises(ValueError, match="vocabulary"):
        load_speculator(settings, target, "cpu", LoadProgress(interactive=False))
    ok = load_speculator(Settings(model=str(tiny("qwen3")), draft_model=str(tiny("llama_tied")), dtype="float32"),
                         target, "cpu", LoadProgress(interactive=False))
    assert ok is not None and ok.draft is not None
    assert load_speculator(Settings(model=str(tiny("qwen3"))), target, "cpu", LoadProgress(interactive=False)) is None


def test_the_break_even_rate_is_what_a_draft_costs_against_what_a_decoded_token_makes() -> None:
    cost = StepCost()
    assert cost.break_even(1) is None
    cost.observe(1, drafted=4, seconds=0.2)  # no plain step measured yet: says nothing
    cost.observe(1, drafted=0, seconds=0.1)
    cost.observe(1, drafted=4, seconds=0.14)  # 10 ms per drafted token, 100 ms per decoded one: 0.1
    assert cost.break_even(1) == pytest.approx(0.1)
    cost.observe(8, drafted=0, seconds=0.2)
    cost.observe(8, drafted=32, seconds=0.52)  # the same 10 ms, but 25 ms per decoded token: 0.4
    assert cost.break_even(8) == pytest.approx(0.4)
    decisions = [cost.explore(3) for _ in range(2 * EXPLORE_EVERY)]
    assert [i + 1 for i, d in enumerate(decisions) if d] == [EXPLORE_EVERY - 1, EXPLORE_EVERY, 2 * EXPLORE_EVERY - 1,
                                                            2 * EXPLORE_EVERY]


def test_rows_pause_below_the_measured_break_even_rate() -> None:
    """Where a drafted token costs nearly what a decoded one makes, a row accepting half its drafts pauses; with
    the fixed rule (not measured) it would go on."""
    tokens = [1, 2, 3, 4, 5, 6, 7, 8] * 6
    for measure, paused in ((True, True), (False, False)):
        spec, row = ngram(4, measure=measure), object()
        if measure:
            spec.observe_step(1, 0, 0.1)
            spec.observe_step(1, 4, 0.1 + 4 * 0.09)  # break-even 0.9
        rows = [(row, tokens, 16, GREEDY)]
        for _ in range(3):
            proposal = spec.propose(rows).get(row)
            if proposal is None:
                break
            spec.record(row, len(proposal.tokens), len(proposal.tokens) // 2)
        assert (spec.propose(rows) == {}) == paused



def test_where_no_acceptance_pays_rows_draft_only_in_the_probing_steps() -> None:
    """A drafted token costing more than a decoded one makes (break-even 1.2): a row accepting every draft still
    drafts only in two steps of each PROBE_EVERY, paused or not, and decodes plainly in the rest."""
    spec, row = ngram(4), object()
    spec.observe_step(1, 0, 0.1)
    spec.observe_step(1, 4, 0.1 + 4 * 0.12)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8] * 6
    drafted = []
    for step in range(1, 2 * PROBE_EVERY + 1):
        proposal = spec.propose([(row, tokens, 16, GREEDY)]).get(row)
        if proposal is not None:
            drafted.append(step)
            spec.record(row, len(proposal.tokens), len(proposal.tokens))  # all accepted: the row pauses anyway
    assert drafted == [1, 2, PROBE_EVERY + 1, PROBE_EVERY + 2]



def test_the_plain_step_right_after_drafting_is_not_timed() -> None:
    """A verification waits for the device, so the plain step after it runs without an overlapping step: its time
    is not what plain decoding costs. The next plain step's is."""
    spec, row = ngram(4), object()
    tokens = [1, 2, 3, 4, 5, 6, 7, 8] * 6
    assert spec.propose([(row, tokens, 16, GREEDY)])
    for _ in range(4):  # the row pauses
        spec.record(row, 4, 0)
    assert spec.propose([(row, tokens, 16, GREEDY)]) == {}
    spec.observe_step(1, 0, 5.0)  # not timed
    assert spec.propose([(row, tokens, 16, GREEDY)]) == {}
    spec.observe_step(1, 0, 0.1)
    spec.observe_step(1, 4, 0.14)
    assert spec.cost.break_even(1) == pytest.approx(0.1)

def test_a_draft_catching_a_row_up_does_not_count_as_the_cost_of_drafting(tiny) -> None:
    """The step in which the draft model prefills a row's prompt says nothing about what a draft costs; the next
    one, continuing from the draft's cache, does."""
    draft = load_runner(tiny("qwen3"), dtype="float32")
    spec, key = Speculator(SpeculativeConfig("draft", 4), DraftModel(draft)), object()
    spec.observe_step(1, 0, 0.1)
    tokens = list(PROMPTS[0])
    first = spec.propose([(key, tokens, 4, GREEDY)])[key].tokens
    spec.observe_step(1, len(first), 10.0)  # the prompt's prefill in the draft: not a draft's cost
    assert spec.cost.break_even(1) is None
    tokens += first + [3]
    spec.propose([(key, tokens, 4, GREEDY)])
    spec.observe_step(1, 4, 0.14)
    assert spec.cost.break_even(1) == pytest.approx(0.1)
    spec.retain(())
    assert draft.blocks.num_used == 0

def test_grammar_constrained_rows_speculate_under_their_masks(tiny) -> None:
    """Each drafted position is verified under the grammar's mask there (a refused draft is rejected) and the
    grammar rolled back: greedy outputs equal those without speculation, sampled ones match the grammar."""
    import re

    from server.grammar.compiler import GrammarCompiler, GrammarSpec

    runner = load_runner(tiny("qwen3"), dtype="float32")
    regex = r"((ab|cd|abc) ){3,12}ef"
    grammar = GrammarCompiler(runner.tokenizer).compile(GrammarSpec("regex", regex))
    ends = frozenset(runner.tokenizer.end_token_ids)
    requests = [{"prompt_ids": p, "grammar": grammar, "stop_token_ids": ends, "ignore_eos": False, "max_tokens": 40}
                for p in PROMPTS[:2]]
    sampled = [r | {"params": SamplingParams(temperature=1.0, seed=3), "n": 2} for r in requests]
    plain, _ = generate(runner, requests + [{"prompt_ids": PROMPTS[3]}])
    spec = ngram(measure=False)
    fast, _ = generate(runner, requests + [{"prompt_ids": PROMPTS[3]}] + sampled, spec)
    assert [[c.tokens for c in g] for g in fast[:3]] == [[c.tokens for c in g] for g in plain]
    for g in fast[:2] + fast[3:]:
        for c in g:
            assert c.finish == "stop" and re.fullmatch(regex, c.text), c.text
    assert spec.stats.num_drafts > 0
    assert runner.blocks.num_used == 0

