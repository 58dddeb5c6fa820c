"""The acceptance rule: exact counts on constructed greedy cases, the sampler's own processing at every drafted
position, and (chi-square, many draws on a small vocabulary) sampled outputs that follow the target's distribution
whatever was drafted."""
from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chisquare

from server.sampling.params import SamplingParams
from server.sampling.sampler import SequenceSampler, sample_batch, sampling_probs
from server.speculative.rejection import DraftCheck, verify_drafts

V = 6


def sampler(seed: int | None = 0, **params) -> SequenceSampler:
    return SequenceSampler(SamplingParams(seed=seed, **params), V, prompt_ids=[0, 1])


def one_hot_logits(tokens: list[int]) -> torch.Tensor:
    """Logits whose argmax at row i is tokens[i], with clear margins."""
    x = torch.randn(len(tokens), V, generator=torch.Generator().manual_seed(1))
    x[torch.arange(len(tokens)), tokens] = 10.0
    return x


@pytest.mark.parametrize("drafts, target, accepted", [
    ([3, 4, 5], [3, 4, 1, 2], 2),   # the third draft differs: the target's token there ends the step
    ([3, 4, 5], [3, 4, 5, 2], 3),   # all accepted, and the bonus token after them
    ([3, 4, 5], [1, 4, 5, 2], 0),   # the first differs: later matches do not count
    ([2], [2, 0], 1),
])
def test_greedy_accepts_exactly_while_drafts_equal_the_argmax(drafts: list[int], target: list[int],
                                                             accepted: int) -> None:
    views = sampler(temperature=0, logprobs=True, top_logprobs=1).lookahead(drafts)
    logits = one_hot_logits(target)
    (result,) = verify_drafts(logits, [DraftCheck(drafts, views)])
    assert result.accepted == accepted
    assert [s.token for s in result.sampled] == drafts[:accepted] + [target[accepted]]
    logp = torch.log_softmax(logits.double(), -1)
    for i, s in enumerate(result.sampled):  # the target's raw logprobs of each emitted token
        assert s.logprob == pytest.approx(float(logp[i, s.token]), rel=1e-5, abs=1e-7)
        assert s.top_logprobs[0][0] == target[i]


def test_every_position_sees_the_penalties_of_the_drafts_before_it() -> None:
    """Greedy with a repetition and presence penalty and a bias: verifying position by position equals sampling
    each position with a sampler that observed the drafts before it."""
    params = dict(temperature=0, repetition_penalty=1.8, presence_penalty=1.5, logit_bias={5: 0.7})
    torch.manual_seed(3)
    for _ in range(50):
        logits = torch.randn(4, V) * 2
        drafts = torch.randint(0, V, (3,)).tolist()
        (result,) = verify_drafts(logits, [DraftCheck(drafts, sampler(**params).lookahead(drafts))])
        reference, expected = sampler(**params), []
        for i in range(4):
            token = sample_batch(logits[i:i + 1], [reference])[0].token
            expected.append(token)
            if i == 3 or token != drafts[i]:
                break
            reference.observe(token)
        assert [s.token for s in result.sampled] == expected
        assert result.accepted == len(expected) - 1


def _histogram(tokens: list[int]) -> list[int]:
    return torch.bincount(torch.tensor(tokens, dtype=torch.long), minlength=V).tolist()


def _assert_follows(tokens: list[int], probs: torch.Tensor) -> None:
    """A chi-square test that `tokens` were drawn from `probs` [V]; impossible tokens never appear."""
    counts = _histogram(tokens)
    possible = [t for t in range(V) if probs[t] > 0]
    assert all(counts[t] == 0 for t in range(V) if t not in possible)
    if len(possible) == 1:
        return
    mass = sum(float(probs[t]) for t in possible)
    expected = [float(probs[t]) / mass * len(tokens) for t in possible]
    result = chisquare([counts[t] for t in possible], expected)
    assert result.pvalue > 1e-3, (counts, expected)


CASES = [
    dict(temperature=0.9),
    dict(temperature=1.3, top_k=4, frequency_penalty=0.8),
    dict(temperature=1.2, top_p=0.95, min_p=0.02, repetition_penalty=1.3, logit_bias={2: 1.0}),
]


@pytest.mark.parametrize("params", CASES)
@pytest.mark.parametrize("proposal", ["point", "distribution"])
def test_sampled_outputs_follow_the_target_distribution(params: dict, proposal: str) -> None:
    """The first token of each step follows p_0, and the second, when the first was the first draft, follows p_1
    (the distribution after that draft): whether drafts are a fixed guess or drawn from a draft distribution q."""
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(3, V, generator=gen) * 1.5
    q = torch.softmax(torch.randn(2, V, generator=gen), -1)  # the draft's distributions at its two positions
    draws = 4000
    base = sampler(seed=11, **params)
    sampled_drafts = torch.multinomial(q, draws, replacement=True, generator=gen).T.tolist()  # [draws, 2]
    checks = [DraftCheck([2, 3], base.lookahead([2, 3])) if proposal == "point" else
              DraftCheck(drafts, base.lookahead(drafts), q) for drafts in sampled_drafts]
    results = verify_drafts(logits.repeat(draws, 1), checks)
    first = [r.sampled[0].token for r in results]
    p0 = sampling_probs(logits[:1], [base])[0]
    assert (p0 > 0).sum() >= 3  # a distribution worth testing
    _assert_follows(first, p0)
    # Given the first token equals the first draft, the second follows p_1 after that token.
    for d1 in range(V):
        seconds = [r.sampled[1].token for r, c in zip(results, checks) if c.drafts[0] == d1 and r.accepted >= 1]
        if len(seconds) < 300:
            continue
        after = sampler(seed=0, **params)
        after.observe(d1)
        _assert_follows(seconds, sampling_probs(logits[1:2], [after])[0])
    # Accepted counts are consistent with the tokens: the accepted drafts are the leading tokens.
    for r, c in zip(results, checks):
        assert [s.token for s in r.sampled[:r.accepted]] == c.drafts[:r.accepted]
        assert len(r.sampled) == r.accepted + 1


def test_a_point_mass_draft_is_accepted_with_the_targets_probability() -> None:
    """With q a point mass, P(accept d) = p(d): counted over many independent draws."""
    logits = torch.tensor([[0.0, 1.0, 2.0, 0.5, -1.0, 0.3], [0.0] * V])
    base = sampler(seed=5)
    p = sampling_probs(logits[:1], [base])[0]
    draws = 10000
    results = verify_drafts(logits.repeat(draws, 1), [DraftCheck([1], base.lookahead([1])) for _ in range(draws)])
    rate = sum(r.accepted for r in results) / draws
    assert abs(rate - float(p[1])) < 4 * math.sqrt(float(p[1]) * (1 - float(p[1])) / draws)


def test_mixed_greedy_and_sampled_rows_in_one_call() -> None:
    logits = one_hot_logits([3, 4, 5, 1, 1, 1])
    greedy = DraftCheck([3, 0], sampler(temperature=0).lookahead([3, 0]))
    hot = DraftCheck([1, 1], sampler(seed=2, temperature=1.0, top_k=1).lookahead([1, 1]))  # top_k 1: argmax
    g, h = verify_drafts(logits, [greedy, hot])
    assert (g.accepted, [s.token for s in g.sampled]) == (1, [3, 4])
    assert (h.accepted, [s.token for s in h.sampled]) == (2, [1, 1, 1])  # top_k 1 samples the argmax
