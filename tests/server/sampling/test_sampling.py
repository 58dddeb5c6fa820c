"""Batched sampling: greedy, seeds, row independence, the sampled distribution, truncation against transformers'
warpers, penalties, logit_bias and raw logprobs."""
from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch
from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from server.sampling.params import GREEDY_TEMPERATURE, SamplingParams
from server.sampling.sampler import SampledToken, SequenceSampler, inverse_cdf, sample_batch, sampling_probs

DRAWS = 20_000


def sampler(vocab: int, prompt: Sequence[int] = (), offset: int = 0, **params) -> SequenceSampler:
    return SequenceSampler(SamplingParams(**params), vocab, list(prompt), seed_offset=offset)


def random_logits(rows: int, vocab: int, scale: float = 3.0, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def empirical(logits_row: torch.Tensor, n: int = DRAWS, **params) -> torch.Tensor:
    """Frequencies of `n` draws for one row of logits: n samplers with seeds 0..n-1, sampled as one batch."""
    vocab = logits_row.shape[0]
    samplers = [sampler(vocab, seed=i, **params) for i in range(n)]
    tokens = [t.token for t in sample_batch(logits_row.expand(n, vocab).contiguous(), samplers)]
    return torch.bincount(torch.tensor(tokens), minlength=vocab).double() / n


def transformers_probs(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                       min_p: float = 0.0) -> torch.Tensor:
    """The reference: transformers' warpers in our documented order, on [B, vocab]."""
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    if min_p > 0:
        scores = MinPLogitsWarper(min_p)(None, scores)
    return torch.softmax(scores, -1)


def assert_same_distribution(ours: torch.Tensor, reference: torch.Tensor) -> None:
    assert torch.equal(ours > 0, reference > 0), "different sets of tokens with nonzero probability"
    torch.testing.assert_close(ours, reference, atol=1e-6, rtol=1e-4)


# --- parameters ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", math.nan), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2),
    ("min_p", -0.1), ("min_p", 1.1), ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("top_logprobs", 21), ("top_logprobs", -1), ("presence_penalty", math.inf),
])
def test_nonsense_params_raise_naming_the_field(field: str, value: float) -> None:
    kwargs = {field: value, "logprobs": True}
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_params_accept_the_boundaries_and_copy_logit_bias() -> None:
    SamplingParams(temperature=0, top_p=1, top_k=-1, min_p=1, logprobs=True, top_logprobs=20)
    bias = {"7": -100.0}
    params = SamplingParams(logit_bias=bias)
    bias[8] = 5.0
    assert params.logit_bias == {7: -100.0}
    assert params.is_greedy() is False and SamplingParams(temperature=0).is_greedy() is True
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(top_logprobs=3)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={"x": 1.0})


def test_out_of_range_ids_and_shapes_raise() -> None:
    with pytest.raises(ValueError, match="logit_bias"):
        sampler(10, logit_bias={10: 1.0})
    with pytest.raises(ValueError, match="prompt"):
        sampler(10, prompt=[3, 12], repetition_penalty=1.2)
    with pytest.raises(ValueError, match="out of range"):
        sampler(10).observe(10)
    with pytest.raises(ValueError, match="vocab"):
        sample_batch(torch.zeros(1, 11), [sampler(10)])
    with pytest.raises(ValueError):
        sample_batch(torch.zeros(2, 10), [sampler(10)])
    assert sample_batch(torch.zeros(0, 10), []) == []


# --- greedy and seeds ---------------------------------------------------------------------------------------

def test_greedy_is_argmax() -> None:
    logits = random_logits(8, 1000)
    out = sample_batch(logits, [sampler(1000, temperature=0) for _ in range(8)])
    assert [t.token for t in out] == logits.argmax(-1).tolist()
    assert all(t.logprob is None and t.top_logprobs is None for t in out)


def test_low_temperature_is_greedy() -> None:
    logits = random_logits(16, 500, seed=1)
    out = sample_batch(logits, [sampler(500, temperature=1e-3, seed=i) for i in range(16)])
    assert [t.token for t in out] == logits.argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-12, GREEDY_TEMPERATURE / 2])
def test_temperatures_too_small_to_divide_by_are_greedy(temperature: float) -> None:
    """Logits / 1e-300 overflow float32 to inf and the draw's weights to NaN: such rows take the argmax instead."""
    logits = random_logits(4, 300, seed=2)
    extremes = dict(prompt=[int(logits[0].argmax())], repetition_penalty=5e-324,
                    logit_bias={7: 100.0, 8: -100.0})
    samplers = [sampler(300, temperature=temperature, seed=i, **extremes) for i in range(4)]
    greedy = sampling_probs(logits, [sampler(300, temperature=0, **extremes) for _ in range(4)])
    assert [t.token for t in sample_batch(logits, samplers)] == greedy.argmax(-1).tolist()


def test_the_extreme_parameters_still_draw_from_finite_weights() -> None:
    """The smallest sampled temperature with the smallest repetition penalty and the largest biases: the draw's
    distribution stays finite and sums to 1, and each token drawn is one of positive probability."""
    logits = random_logits(8, 1000, scale=10.0, seed=3)
    params = dict(temperature=GREEDY_TEMPERATURE, repetition_penalty=5e-324, top_p=0.9,
                  logit_bias={1: 100.0, 2: 100.0, 3: -100.0})
    samplers = [sampler(1000, prompt=[1, 3, 5], seed=i, **params) for i in range(8)]
    probs = sampling_probs(logits, samplers)
    assert torch.isfinite(probs).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(8), atol=1e-5, rtol=0)
    tokens = [t.token for t in sample_batch(logits, [sampler(1000, prompt=[1, 3, 5], seed=i, **params)
                                                      for i in range(8)])]
    assert all(probs[r, t] > 0 for r, t in enumerate(tokens))


def generate(s: SequenceSampler, steps: int = 40, vocab: int = 50) -> list[int]:
    tokens = []
    for step in range(steps):
        token = sample_batch(random_logits(1, vocab, scale=0.5, seed=step), [s])[0].token
        s.observe(token)
        tokens.append(token)
    return tokens


def test_seed_reproduces_the_tokens_and_other_seeds_differ() -> None:
    params = dict(temperature=1.0, top_p=0.95, presence_penalty=0.3)
    assert generate(sampler(50, seed=123, **params)) == generate(sampler(50, seed=123, **params))
    assert generate(sampler(50, seed=123, **params)) != generate(sampler(50, seed=124, **params))
    # seed_offset tells the n choices of one request apart, reproducibly.
    assert generate(sampler(50, seed=123, offset=1, **params)) == generate(sampler(50, seed=123, offset=1, **params))
    assert generate(sampler(50, seed=123, offset=1, **params)) != generate(sampler(50, seed=123, **params))
    assert generate(sampler(50, **params)) != generate(sampler(50, **params))  # unseeded: from os entropy


ROW_PARAMS = [
    dict(temperature=0),
    dict(temperature=0.8, seed=1),
    dict(temperature=1.0, top_k=5, seed=2),
    dict(temperature=0.7, top_p=0.9, seed=3),
    dict(temperature=1.2, top_k=300, top_p=0.95, seed=4),  # the 4096 tier
    dict(temperature=1.0, top_p=0.999, seed=5),  # the nucleus outgrows every tier: full sort
    dict(temperature=0.9, min_p=0.1, seed=6),
    dict(temperature=1.0, top_k=40, top_p=0.8, min_p=0.05, seed=7),
    dict(temperature=0, repetition_penalty=1.5, presence_penalty=1.0, logit_bias={3: 5.0}),
    dict(temperature=1.1, frequency_penalty=0.5, repetition_penalty=0.9, logit_bias={4: -100.0}, seed=8),
    dict(temperature=0.5, top_p=0.5, logprobs=True, top_logprobs=3, seed=9),
]


def test_a_row_samples_the_same_alone_as_in_any_batch() -> None:
    vocab, steps = 5000, 6
    logits = [random_logits(len(ROW_PARAMS), vocab, scale=1.0 + step, seed=step) for step in range(steps)]
    batched = [sampler(vocab, prompt=[1, 2, 3], **p) for p in ROW_PARAMS]
    together = []
    for step in range(steps):
        out = sample_batch(logits[step], batched)
        for s, t in zip(batched, out):
            s.observe(t.token)
        together.append([t.token for t in out])
    # Each row alone, and in a reversed batch, gives the same tokens.
    for order in ([[i] for i in range(len(ROW_PARAMS))], [list(reversed(range(len(ROW_PARAMS))))]):
        for rows in order:
            samplers = [sampler(vocab, prompt=[1, 2, 3], **ROW_PARAMS[i]) for i in rows]
            for step in range(steps):
                out = sample_batch(logits[step][rows], samplers)
                for s, t, i in zip(samplers, out, rows):
                    assert t.token == together[step][i], (ROW_PARAMS[i], step)
                    s.observe(t.token)


def test_mixed_batch_greedy_rows_argmax_and_sampled_rows_within_their_truncation() -> None:
    vocab = 300
    logits = random_logits(len(ROW_PARAMS), vocab, seed=5)
    samplers = [sampler(vocab, **p) for p in ROW_PARAMS]
    allowed = sampling_probs(logits, samplers) > 0
    for _ in range(30):
        out = sample_batch(logits, samplers)
        assert all(allowed[i, t.token] for i, t in enumerate(out))
    assert out[0].token == logits[0].argmax()
    assert allowed[2].sum() == 5  # top_k=5


# --- the sampled distribution -------------------------------------------------------------------------------

# With 20,000 draws a frequency's standard deviation is at most sqrt(0.25 / 20000) = 0.0035, so 0.015 is over
# 4 standard deviations for every token, while the errors these tests guard against (the wrong temperature,
# an unnormalised or shifted CDF) move some frequency by 0.05 or more.
TOLERANCE = 0.015
TINY = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0])


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_draws_follow_softmax_of_logits_over_temperature(temperature: float) -> None:
    freq = empirical(TINY, temperature=temperature)
    expected = torch.softmax(TINY.double() / temperature, -1)
    assert (freq - expected).abs().max() < TOLERANCE
    wrong = torch.softmax(TINY.double() / (temperature * 1.3), -1)
    assert (wrong - expected).abs().max() > 3 * TOLERANCE  # the bound separates a wrong temperature


def test_truncated_draws_follow_the_truncated_distribution() -> None:
    logits = random_logits(1, 300, scale=2.5, seed=3)[0]  # vocab > 64: the candidate path, not the full sort
    params = dict(temperature=0.8, top_k=20, top_p=0.7, min_p=0.02)
    probs = sampling_probs(logits[None], [sampler(300, **params)])[0].double()
    assert 3 <= (probs > 0).sum() <= 20
    freq = empirical(logits, **params)
    assert freq[probs == 0].sum() == 0
    assert (freq - probs).abs().max() < TOLERANCE


def test_top_k_never_samples_outside_the_k_most_likely() -> None:
    freq = empirical(TINY, n=5000, temperature=2.0, top_k=3)
    assert freq[3:].sum() == 0 and (freq[:3] > 0).all()


# --- truncation against transformers ------------------------------------------------------------------------

# vocab 6000 reaches every path: top-64/256/4096 candidates, the full sort, and no sort at all.
@pytest.mark.parametrize("temperature, top_k, top_p, min_p, scale", [
    (1.0, 3, 1.0, 0.0, 3.0), (0.7, 100, 1.0, 0.0, 3.0), (1.3, 1000, 1.0, 0.0, 1.0), (1.0, 5000, 1.0, 0.0, 1.0),
    (1.0, 0, 0.1, 0.0, 3.0), (0.7, 0, 0.5, 0.0, 3.0), (1.0, 0, 0.9, 0.0, 3.0), (1.0, 0, 0.9, 0.0, 0.3),
    (1.5, 0, 0.99, 0.0, 0.5), (1.0, 50, 0.9, 0.0, 1.0), (1.0, 2000, 0.95, 0.0, 0.5),
    (1.0, 0, 1.0, 0.1, 3.0), (0.5, 0, 1.0, 0.5, 1.0), (1.0, 40, 0.95, 0.05, 2.0), (1.0, 0, 0.9, 0.01, 0.5),
])
def test_truncation_matches_transformers(temperature: float, top_k: int, top_p: float, min_p: float,
                                         scale: float) -> None:
    logits = random_logits(4, 6000, scale=scale, seed=top_k + int(100 * top_p))
    samplers = [sampler(6000, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p) for _ in range(4)]
    ours = sampling_probs(logits, samplers)
    assert_same_distribution(ours, transformers_probs(logits, temperature, top_k, top_p, min_p))


def test_top_p_keeps_the_minimal_nucleus() -> None:
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    for top_p, kept in [(0.35, 1), (0.39, 1), (0.41, 2), (0.69, 2), (0.71, 3), (0.89, 3), (0.91, 4)]:
        probs = sampling_probs(logits, [sampler(4, top_p=top_p)])[0]
        assert (probs > 0).sum() == kept, top_p


# --- penalties and bias -------------------------------------------------------------------------------------

def test_presence_and_frequency_penalties_change_only_the_generated_tokens() -> None:
    vocab, presence, frequency = 20, 0.5, 0.25
    logits = random_logits(1, vocab, seed=7)
    s = sampler(vocab, prompt=[9, 10], presence_penalty=presence, frequency_penalty=frequency)
    for token in [3, 3, 5, 3, 7]:
        s.observe(token)
    delta = sampling_probs(logits, [s])[0].log() - torch.log_softmax(logits[0], -1)
    delta = delta - delta[0]  # softmax forgets a common shift; token 0 is not penalised
    expected = torch.zeros(vocab)
    expected[3], expected[5], expected[7] = -(presence + 3 * frequency), -(presence + frequency), -(presence + frequency)
    torch.testing.assert_close(delta, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_matches_transformers(penalty: float) -> None:
    vocab = 64
    logits = random_logits(2, vocab, seed=11)
    prompt, generated = [1, 2, 3, 2, 40], [5, 6, 50, 5]
    samplers = [sampler(vocab, prompt=prompt, repetition_penalty=penalty) for _ in range(2)]
    for s in samplers:
        for token in generated:
            s.observe(token)
    ids = torch.tensor([prompt + generated] * 2)
    reference = torch.softmax(RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone()), -1)
    seen = torch.zeros(vocab, dtype=torch.bool)
    seen[ids[0]] = True
    assert ((logits[:, seen] > 0).any() and (logits[:, seen] < 0).any())  # both branches are exercised
    torch.testing.assert_close(sampling_probs(logits, samplers), reference, atol=1e-7, rtol=1e-5)
    # The greedy choice follows the penalised logits.
    greedy = [sampler(vocab, prompt=prompt, repetition_penalty=penalty, temperature=0) for _ in range(2)]
    for s in greedy:
        for token in generated:
            s.observe(token)
    assert [t.token for t in sample_batch(logits, greedy)] == reference.argmax(-1).tolist()


def test_logit_bias_minus_100_bans_and_plus_100_forces() -> None:
    logits = TINY.clone()
    favourite, outsider = 0, 7
    banned = empirical(logits, n=5000, temperature=2.0, logit_bias={favourite: -100.0})
    assert banned[favourite] == 0 and banned[1] > 0.1
    forced = empirical(logits, n=5000, temperature=2.0, top_p=0.99, logit_bias={outsider: 100.0})
    assert forced[outsider] == 1
    greedy = sample_batch(logits[None], [sampler(8, temperature=0, logit_bias={outsider: 100.0})])
    assert greedy[0].token == outsider


def test_inputs_are_not_modified_and_inference_tensors_work() -> None:
    with torch.inference_mode():
        logits = random_logits(2, 100)
        samplers = [sampler(100, prompt=[1], repetition_penalty=2.0, presence_penalty=1.0, logit_bias={5: 3.0})
                    for _ in range(2)]
    before = logits.clone()
    out = sample_batch(logits, samplers)
    for s, t in zip(samplers, out):
        s.observe(t.token)  # outside inference_mode, on state built inside it
    assert torch.equal(logits, before)
    assert sample_batch(logits.bfloat16(), samplers)[0].token in range(100)


# --- extreme values (test_sampling_fuzz.py covers them all; these pin the documented outcomes) ---

@pytest.mark.parametrize("penalty", [5e-324, 1e-300, 1e-40])
def test_a_tiny_repetition_penalty_neither_crashes_the_batch_nor_changes_its_other_rows(penalty: float) -> None:
    vocab, prompt = 300, [3, 7, 11, 250]
    logits = random_logits(3, vocab, seed=21)
    logits[1, prompt] = torch.tensor([2.0, -1.0, 0.5, 3.0])
    params = [dict(temperature=0.8, top_p=0.9, seed=1), dict(repetition_penalty=penalty, seed=2), dict(temperature=0)]
    out = sample_batch(logits, [sampler(vocab, prompt, **p) for p in params])
    alone = [sample_batch(logits[i:i + 1], [sampler(vocab, prompt, **params[i])])[0] for i in (0, 2)]
    assert [out[0], out[2]] == alone
    # The seen positive logits divided by the penalty overflow float32: those tokens share all the probability.
    probs = sampling_probs(logits[1:2], [sampler(vocab, prompt, repetition_penalty=penalty)])[0]
    assert out[1].token in (3, 11, 250)
    torch.testing.assert_close(probs[[3, 11, 250]], torch.full((3,), 1 / 3))


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 9.99e-6])
def test_a_temperature_below_the_greedy_threshold_is_greedy(temperature: float) -> None:
    logits = random_logits(4, 500, seed=2)
    logits[:, 0] = logits[:, 1] = logits.amax(-1) + 1e-6  # nearly tied: dividing by the temperature would matter
    assert SamplingParams(temperature=temperature).is_greedy() and not SamplingParams(temperature=1e-5).is_greedy()
    out = sample_batch(logits, [sampler(500, temperature=temperature, seed=i) for i in range(4)])
    assert [t.token for t in out] == logits.argmax(-1).tolist()


def test_non_finite_logits_nan_is_never_drawn_and_infinities_share_the_mass() -> None:
    nan, inf = math.nan, math.inf
    logits = torch.tensor([[nan, 1.0, 2.0, nan, -inf], [0.0, inf, 5.0, inf, nan], [nan] * 5, [-inf] * 5])
    for params in (dict(), dict(temperature=0), dict(top_k=2, top_p=0.5, min_p=0.1, repetition_penalty=2.0)):
        samplers = [sampler(5, prompt=[1, 2], logprobs=True, top_logprobs=5, **params) for _ in range(4)]
        probs = sampling_probs(logits, samplers)
        assert probs[0, [0, 3, 4]].sum() == 0 and probs[1, [0, 2, 4]].sum() == 0
        assert torch.equal(probs[2:], torch.eye(5)[[0, 0]])  # no possible token: token 0
        for _ in range(10):
            out = sample_batch(logits, samplers)
            assert [t.token for t in out][2:] == [0, 0] and probs[0, out[0].token] > 0 and out[1].token in (1, 3)
            assert not any(math.isnan(v) for t in out for v in [t.logprob] + [lp for _, lp in t.top_logprobs])
        if not params:
            torch.testing.assert_close(probs[1, [1, 3]], torch.tensor([0.5, 0.5]))
    assert out[1].logprob == pytest.approx(-math.log(2)) and out[2].logprob == -math.inf


@pytest.mark.parametrize("scale", [1e30, 1e4])
def test_tied_huge_logits_over_the_temperature_share_the_mass_under_top_p(scale: float) -> None:
    # Unshifted, logsumexp of two equal values near 2e30 (or 1e9) rounds the log 2 away: each would weigh 1.
    logits = torch.tensor([[scale, scale, 0.0, -1.0, 2.0]])
    for temperature in (0.5, 1e-5):
        probs = sampling_probs(logits, [sampler(5, temperature=temperature, top_p=0.95)])[0]
        torch.testing.assert_close(probs, torch.tensor([0.5, 0.5, 0, 0, 0]))


def test_every_token_suppressed_gives_token_0_and_a_tiny_top_p_the_most_likely_token() -> None:
    logits = random_logits(2, 50, seed=4)
    everything = sampler(50, temperature=0.7)
    everything.suppressed = torch.arange(50)
    tiny = sampler(50, top_p=5e-324)
    assert [t.token for t in sample_batch(logits, [everything, tiny])] == [0, int(logits[1].argmax())]
    assert torch.equal(sampling_probs(logits, [everything, tiny]), torch.eye(50)[[0, int(logits[1].argmax())]])


# --- logprobs -----------------------------------------------------------------------------------------------

def test_logprobs_are_the_raw_log_softmax_with_sorted_alternatives() -> None:
    vocab = 1000
    logits = random_logits(3, vocab, seed=13)
    samplers = [
        sampler(vocab, temperature=0.3, top_k=10, presence_penalty=2.0, logit_bias={7: 50.0}, seed=1,
                logprobs=True, top_logprobs=5),
        sampler(vocab, temperature=0),
        sampler(vocab, temperature=0, repetition_penalty=3.0, prompt=[int(logits[2].argmax())], logprobs=True),
    ]
    samplers[0].observe(11)
    out: list[SampledToken] = sample_batch(logits, samplers)
    raw = torch.log_softmax(logits, -1)
    assert out[0].token == 7  # the bias decided the token, but not its logprob
    assert out[0].logprob == pytest.approx(raw[0, 7].item(), abs=1e-5)
    top = out[0].top_logprobs
    assert [t for t, _ in top] == raw[0].topk(5).indices.tolist()
    assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
    torch.testing.assert_close(torch.tensor([v for _, v in top]), raw[0].topk(5).values)
    assert torch.logsumexp(raw[0], -1).abs() < 1e-5 and sum(math.exp(v) for _, v in top) <= 1
    assert out[1].logprob is None and out[1].top_logprobs is None
    assert out[2].top_logprobs == [] and out[2].logprob == pytest.approx(raw[2, out[2].token].item(), abs=1e-5)
    assert out[2].token != logits[2].argmax()  # the penalty moved the choice; the logprob stays raw


def test_logprobs_of_a_large_flat_vocabulary_are_the_float64_ones() -> None:
    """One logit of 2 among 262,143 zeros (gemma3's vocabulary; found by test_sampling_fuzz.py): torch's
    CPU log_softmax in float32 is 2.7e-4 off here, the float64 reference is what is sent."""
    vocab = 262_144
    logits = torch.zeros(1, vocab)
    logits[0, 0] = 2.0
    out = sample_batch(logits, [sampler(vocab, temperature=0, logprobs=True, top_logprobs=2)])[0]
    expected = torch.log_softmax(logits.double(), -1)[0]
    assert out.token == 0 and out.logprob == pytest.approx(expected[0].item(), abs=1e-5)
    assert [t for t, _ in out.top_logprobs][0] == 0
    assert [v for _, v in out.top_logprobs] == pytest.approx([expected[0].item(), expected[1].item()], abs=1e-5)


def test_the_logprob_of_a_dominant_token_keeps_its_digits() -> None:
    """A token at 10 among five near 0: its logprob is -1.2e-4, which the log of a float32 sum near 1 gets 4e-4 off
    relatively (found by tests/server/speculative/test_rejection.py); the float64 logprobs to 1e-6 of their size."""
    logits = torch.randn(1, 6, generator=torch.Generator().manual_seed(1))
    logits[0, 3] = 10.0
    out = sample_batch(logits, [sampler(6, temperature=0, logprobs=True, top_logprobs=6)])[0]
    expected = torch.log_softmax(logits.double(), -1)[0]
    assert out.token == 3 and out.logprob == pytest.approx(expected[3].item(), rel=1e-6)
    assert [v for _, v in out.top_logprobs] == pytest.approx(expected.sort(descending=True).values.tolist(), rel=1e-6)


# --- the inverse CDF ----------------------------------------------------------------------------------------

def test_inverse_cdf_matches_a_float64_reference_and_never_picks_zero_weight() -> None:
    gen = torch.Generator().manual_seed(0)
    for n in (1, 7, 64, 1000, 3001):
        weights = torch.rand(4, n, generator=gen) * (torch.rand(4, n, generator=gen) > 0.5)
        weights[:, 0] += 1e-3  # at least one positive weight per row
        for u in [0.0, 0.25, 0.5, 0.999, 1 - 2 ** -53] + torch.rand(20, generator=gen, dtype=torch.float64).tolist():
            got = inverse_cdf(weights, torch.full((4,), u, dtype=torch.float64))
            cdf = weights.double().cumsum(-1)
            want = torch.searchsorted(cdf, (u * cdf[:, -1:]).contiguous(), right=True)[:, 0]
            want = torch.minimum(want, torch.searchsorted(cdf, cdf[:, -1:].contiguous())[:, 0])
            assert (weights.gather(1, got[:, None]) > 0).all()
            assert (got - want).abs().max() <= 1, (n, u)  # a boundary may round either way


def test_inverse_cdf_keeps_the_tail_of_a_large_vocabulary() -> None:
    # One token of mass ~0.9974 and 262,143 of 1e-8 each: in one float32 cumsum each tail step is under half an
    # ulp of the running total and the tail (0.26% of the mass) could never be drawn.
    weights = torch.full((1, 262_144), 1e-8)
    weights[0, 0] = 1.0 - 262_143e-8
    tail_start = weights[0, 0].item() / weights.double().sum().item()
    for u in (tail_start + 1e-4, 0.999, 0.9999):
        got = inverse_cdf(weights, torch.tensor([u], dtype=torch.float64)).item()
        expected = 1 + (u * weights.double().sum().item() - weights[0, 0].item()) / weights[0, 1].item()
        assert abs(got - expected) <= 2, u


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_samples_what_the_cpu_samples() -> None:
    vocab, tokens, probs = 5000, {}, {}
    for device in ("cpu", "cuda"):
        samplers = [SequenceSampler(SamplingParams(**p), vocab, [1, 2, 3], device=device) for p in ROW_PARAMS]
        tokens[device] = []
        for step in range(4):
            logits = random_logits(len(ROW_PARAMS), vocab, scale=1.0 + step, seed=step).to(device)
            out = sample_batch(logits, samplers)
            for s, t in zip(samplers, out):
                s.observe(t.token)
            tokens[device].append([(t.token, t.logprob) for t in out])
        probs[device] = sampling_probs(logits, samplers).cpu()
    for cpu_step, cuda_step in zip(tokens["cpu"], tokens["cuda"]):
        assert [t for t, _ in cpu_step] == [t for t, _ in cuda_step]
        assert [lp is None for _, lp in cpu_step] == [lp is None for _, lp in cuda_step]
    torch.testing.assert_close(probs["cpu"], probs["cuda"], atol=1e-6, rtol=1e-4)
