"""Property tests of the sampler over every value the request schema accepts and any logits (NaN and infinities
included): sample_batch never raises and draws only tokens the rule allows, greedy rows take the argmax of the
adjusted logits, sampling_probs matches an independent per-row reference of the rule (numpy: bias → penalties →
temperature → top-k → top-p → min-p, with margins for float32 rounding), and one row never changes another."""
from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass

import annotated_types
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server.api.openai.protocol import MAX_LOGIT_BIAS, ChatCompletionRequest, OpenAIRequest
from server.sampling.params import GREEDY_TEMPERATURE, SamplingParams
from server.sampling.sampler import SHIFT_ABOVE, SequenceSampler, sample_batch, sampling_probs

F32_MAX = float(np.finfo(np.float32).max)
F32_TINY = 2.0 ** -149
# Values a wild float field is drawn with on top of hypothesis' own choice (those inside the field's bounds).
EDGE_FLOATS = [0.0, 5e-324, 1e-300, 1e-45, 1e-40, 1e-30, 9.99e-6, GREEDY_TEMPERATURE, 1e-3, 0.5, 1.0, 2.0, 10.0]
SPECIAL_LOGITS = [math.nan, math.inf, -math.inf, F32_MAX, -F32_MAX, 1e30, -1e30, 1e-45, 0.0, -0.0, 100.0]


# --- strategies: the request schema's bounds -----------------------------------------------------------------

def schema_bounds(model: type, name: str) -> dict:
    """st.floats/st.integers keyword arguments from a pydantic field's Ge/Gt/Le/Lt constraints."""
    kwargs: dict = {}
    for m in model.model_fields[name].metadata:
        if isinstance(m, annotated_types.Ge):
            kwargs["min_value"] = m.ge
        elif isinstance(m, annotated_types.Gt):
            kwargs["min_value"], kwargs["exclude_min"] = m.gt, True
        elif isinstance(m, annotated_types.Le):
            kwargs["max_value"] = m.le
        elif isinstance(m, annotated_types.Lt):
            kwargs["max_value"], kwargs["exclude_max"] = m.lt, True
    return kwargs


def schema_floats(name: str) -> st.SearchStrategy[float]:
    """Any value the schema accepts for `name`, with its edges and the values that break naive float code."""
    b = schema_bounds(OpenAIRequest, name)
    lo, hi = b["min_value"], b["max_value"]
    inside = [v for v in EDGE_FLOATS + [lo, hi] if (lo < v if b.get("exclude_min") else lo <= v) and v <= hi]
    return st.floats(allow_nan=False, **b) | st.sampled_from(sorted(set(inside)))


@dataclass(frozen=True)
class Field:
    """How to draw one sampling field: values requests use (`tame`), or anything the schema accepts (`wild`)."""

    tame: st.SearchStrategy
    wild: st.SearchStrategy


# Built once: hypothesis strategies are costly to construct per draw.
FIELDS = {
    "temperature": Field(st.sampled_from([0.0, 0.5, 0.8, 1.0, 1.3]), st.just(0.0) | schema_floats("temperature")),
    "top_p": Field(st.sampled_from([1.0, 1.0, 0.95, 0.8, 0.5]), schema_floats("top_p")),
    "min_p": Field(st.sampled_from([0.0, 0.0, 0.05, 0.2]), schema_floats("min_p")),
    "presence_penalty": Field(st.sampled_from([0.0, 0.5, -0.5]), schema_floats("presence_penalty")),
    "frequency_penalty": Field(st.sampled_from([0.0, 0.3, -1.0]), schema_floats("frequency_penalty")),
    "repetition_penalty": Field(st.sampled_from([1.0, 1.1, 1.5, 0.8]),
                                st.just(1.0) | schema_floats("repetition_penalty")),
    "seed": Field(st.none() | st.integers(0, 2 ** 31), st.integers() | st.sampled_from([-2 ** 200, 2 ** 64, -1])),
}
TOP_K = st.integers(**schema_bounds(OpenAIRequest, "top_k"))
TOP_K_EDGES = st.sampled_from([-1, 0, 1, 2, 2 ** 63])
BIAS_VALUE = Field(st.sampled_from([-2.0, 1.0, 3.0]), st.floats(-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
                   | st.sampled_from([-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS]))
TOP_LOGPROBS = st.integers(**schema_bounds(ChatCompletionRequest, "top_logprobs"))
TOKEN_LISTS = st.lists(st.integers(0, 2 ** 16), max_size=8)


@dataclass
class Row:
    params: SamplingParams
    prompt: list[int]
    generated: list[int]
    suppressed: list[int] | None


@st.composite
def sampling_params(draw: st.DrawFn, vocab: int, wild: bool) -> SamplingParams:
    def value(f: Field):  # a wild row has each field wild or tame: one silly value among sane ones is the usual case
        return draw(f.wild if wild and draw(st.booleans()) else f.tame)

    top_k = [0, 40, vocab + draw(st.integers(-1, 1)), draw(TOP_K), draw(TOP_K_EDGES)][draw(st.integers(0, 4))]
    kind = draw(st.sampled_from(["none", "some", "every", "strided"] if wild else ["none", "some"]))
    if kind == "none":
        bias = {}
    elif kind == "some":
        bias = {t % vocab: value(BIAS_VALUE) for t in draw(TOKEN_LISTS)}
    else:  # every token (or every few) the same bias
        bias = dict.fromkeys(range(0, vocab, 1 if kind == "every" else draw(st.integers(2, 5))), value(BIAS_VALUE))
    logprobs = draw(st.booleans())
    return SamplingParams(**{name: value(f) for name, f in FIELDS.items()}, top_k=top_k, logit_bias=bias,
                          logprobs=logprobs, top_logprobs=draw(TOP_LOGPROBS) if logprobs else 0)


@st.composite
def rows(draw: st.DrawFn, vocab: int, wild: bool) -> Row:
    def ids() -> list[int]:
        return [t % vocab for t in draw(TOKEN_LISTS)]

    suppressed = draw(st.sampled_from(["none", "some", "all"] if wild else ["none", "some"]))
    return Row(draw(sampling_params(vocab, wild)), ids(), ids(),
               None if suppressed == "none" else list(range(vocab)) if suppressed == "all" else ids() or [0])


OVERWRITES = st.lists(st.tuples(st.integers(0, 7), st.integers(0, 2 ** 20),
                                st.floats(width=32) | st.sampled_from(SPECIAL_LOGITS)), max_size=12)
TAME_OVERWRITES = st.lists(st.tuples(st.integers(0, 7), st.integers(0, 2 ** 20),
                                     st.sampled_from([math.nan, -math.inf])), max_size=4)


@st.composite
def logits_rows(draw: st.DrawFn, n: int, vocab: int, wild: bool) -> np.ndarray:
    """[n, vocab] float32: seeded normal logits (optionally rounded into ties), with some positions overwritten;
    wild ones at any scale, with any float32 (NaN, infinities, extremes) written over them, even whole rows."""
    gen = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    scale = draw(st.sampled_from([0.0, 1e-30, 1e-3, 1.0, 30.0, 1e4, 1e30, F32_MAX] if wild else [1.0, 3.0]))
    x = gen.standard_normal((n, vocab)) * scale
    if draw(st.booleans()):
        x = np.round(x)  # ties
    with np.errstate(over="ignore"):
        x = x.astype(np.float32)
    if draw(st.booleans()):
        x[:] = x[0]  # every row the same logits
    for row, col, v in draw(OVERWRITES if wild else TAME_OVERWRITES):
        x[row % n, col % vocab] = v
    if wild and draw(st.booleans()):
        x[draw(st.integers(0, n - 1))] = draw(st.sampled_from([math.nan, -math.inf, math.inf]))  # a whole row
    return x


@st.composite
def batches(draw: st.DrawFn, vocab: st.SearchStrategy[int], max_rows: int = 4) -> tuple[np.ndarray, list[Row]]:
    """Half the time tame values, which test the rule's numbers closely; else anything the schema accepts."""
    v, wild = draw(vocab), draw(st.booleans())
    batch = draw(st.lists(rows(v, wild), min_size=1, max_size=max_rows))
    return draw(logits_rows(len(batch), v, wild)), batch


def samplers_for(batch: list[Row], vocab: int) -> list[SequenceSampler]:
    out = []
    for row in batch:
        s = SequenceSampler(row.params, vocab, row.prompt)
        for token in row.generated:
            s.observe(token)
        s.suppressed = None if row.suppressed is None else torch.tensor(sorted(set(row.suppressed)))
        out.append(s)
    return out


# --- the reference -------------------------------------------------------------------------------------------

def reference_adjusted(raw: np.ndarray, row: Row) -> np.ndarray:
    """bias → repetition → frequency/presence → suppression, in float32 one token at a time; then NaN as -inf,
    +inf as the largest float32, and token 0 at 0 when no token is possible (the module docstring's rule)."""
    p, f32 = row.params, np.float32
    x = raw.astype(np.float32).copy()
    with np.errstate(all="ignore"):
        if p.logit_bias:  # the ids are distinct: one float32 addition each
            ids = np.fromiter(p.logit_bias, dtype=np.int64)
            x[ids] = x[ids] + np.fromiter(p.logit_bias.values(), dtype=np.float64).astype(np.float32)
        if p.repetition_penalty != 1:
            pen = f32(max(p.repetition_penalty, F32_TINY))
            for token in set(row.prompt) | set(row.generated):
                x[token] = x[token] / pen if x[token] > 0 else x[token] * pen
        if p.presence_penalty != 0 or p.frequency_penalty != 0:
            for token, count in Counter(row.generated).items():
                x[token] = x[token] - f32(count) * f32(p.frequency_penalty) - f32(p.presence_penalty)
    if row.suppressed is not None:
        x[row.suppressed] = -np.inf
    x[np.isnan(x)] = -np.inf
    x[x == np.inf] = F32_MAX
    if (x == -np.inf).all():
        x[0] = 0
    return x


@dataclass
class Expected:
    possible: np.ndarray  # bool [V]: tokens the rule may keep, allowing for float32 rounding at its boundaries
    certain: np.ndarray  # bool [V]: tokens the rule keeps whatever the rounding
    z: np.ndarray  # float64 [V]: the adjusted logits over temperature, the largest at 0
    tolerance: float  # how far float32 may move a z (log-space)
    k: int


def reference_truncation(x: np.ndarray, p: SamplingParams) -> Expected:
    """temperature → top-k → top-p → min-p in float64 on the adjusted logits `x`, with rounding margins."""
    V, T = len(x), p.temperature
    x64 = x.astype(np.float64)
    top = x64.max()
    with np.errstate(invalid="ignore", over="ignore"):
        z = (x64 - top) / T
    z[np.isnan(z)] = -np.inf
    # float32 rounds x / T, the subtraction, logsumexp and exp: a few units of 6e-8 of the magnitudes involved.
    relevant = z >= -150
    shifted = abs(top) > SHIFT_ABOVE * T * 1.001  # near the threshold float32 may decide either way
    magnitude = np.abs(x64 - top) if shifted else np.abs(x64) + abs(top)
    tolerance = float(1e-5 + 5e-7 * (magnitude[relevant] / T + np.abs(z[relevant])).max())
    tolerance = min(tolerance, 100.0)  # beyond that float32 keeps no order within the relevant range anyway
    gap, stretch = 2 * tolerance, math.exp(4 * tolerance)
    k = p.top_k if 0 < p.top_k < V else V
    ascending = np.sort(z)
    above_strict = V - np.searchsorted(ascending, z + gap, side="right")  # tokens surely more likely than each
    above_loose = V - np.searchsorted(ascending, z - gap, side="left") - 1  # tokens perhaps more likely
    possible, certain = above_strict < k, above_loose < k
    w = np.exp(z)
    norm = np.sort(w)[::-1][:k].sum()
    probs = w / norm
    if p.top_p < 1:
        # Mass before a token in the sampler's order: at least the surely-more-likely's, at most the perhaps'.
        suffix = np.concatenate([np.cumsum(np.sort(probs)[::-1])[::-1], [0.0]])  # suffix[i]: mass of ascending[i:]
        slack = 1e-6 + 1.2e-7 * V  # a float32 cumulative sum over up to V terms
        before_min = suffix[np.searchsorted(ascending, z + gap, side="right")] / stretch - slack
        before_max = (suffix[np.searchsorted(ascending, z - gap, side="left")] - probs) * stretch + slack
        top_p = max(p.top_p, F32_TINY)
        possible &= before_min < top_p
        certain &= before_max < top_p
    if p.min_p > 0:
        possible &= w >= p.min_p / stretch
        certain &= w >= p.min_p * stretch
    # float32 exp underflows near -104; below -80 a weight may be denormal or 0.
    possible &= z >= -110 - 4 * tolerance
    certain &= z >= -80 + 4 * tolerance
    return Expected(possible, certain, z, tolerance, k)


def reference_logprobs(raw: np.ndarray) -> np.ndarray:
    x = raw.astype(np.float64)
    x[np.isnan(x)] = -np.inf
    x[x == np.inf] = F32_MAX
    if (x == -np.inf).all():
        return x
    top = x.max()
    return x - top - np.log(np.exp(x - top).sum())


# --- checks --------------------------------------------------------------------------------------------------

def check_row(raw: np.ndarray, row: Row, probs: np.ndarray, token: int, logprob: float | None,
              top_logprobs: list[tuple[int, float]] | None) -> None:
    V = len(raw)
    assert 0 <= token < V
    assert np.isfinite(probs).all() and (probs >= 0).all() and abs(probs.sum() - 1) < 1e-4
    x = reference_adjusted(raw, row)
    if row.params.is_greedy():
        greedy = int(np.argmax(x))
        assert token == greedy and probs[greedy] == 1
    else:
        ref = reference_truncation(x, row.params)
        support = probs > 0
        assert support[token], "drew a token of probability 0"
        assert ref.possible[token], "drew a token the rule excludes"
        assert not (support & ~ref.possible).any(), np.flatnonzero(support & ~ref.possible)[:5]
        assert not (ref.certain & ~support).any(), np.flatnonzero(ref.certain & ~support)[:5]
        assert support.sum() <= ref.k
        # The shape: each kept token's probability relative to the most likely kept one follows exp(z).
        anchor = int(np.argmax(probs))
        near = support & (ref.z - ref.z[anchor] > -80)
        got = np.log(probs[near].astype(np.float64)) - math.log(probs[anchor])
        np.testing.assert_allclose(got, ref.z[near] - ref.z[anchor], rtol=0, atol=4 * ref.tolerance + 1e-5)
    if row.suppressed is not None and not (x[1:] == -np.inf).all():
        assert token not in row.suppressed
    if not row.params.logprobs:
        assert logprob is None and top_logprobs is None
        return
    expected = reference_logprobs(raw)
    assert len(top_logprobs) == min(row.params.top_logprobs, V)
    values = [v for _, v in top_logprobs]
    assert values == sorted(values, reverse=True)
    for t, v in [(token, logprob), *top_logprobs]:
        assert not math.isnan(v) and v <= 1e-5
        if expected[t] < -1e30:
            assert v < -1e30
        else:
            assert v == pytest.approx(expected[t], abs=1e-4 + 1e-6 * abs(expected[t]))


def check_batch(logits: np.ndarray, batch: list[Row]) -> None:
    V = logits.shape[1]
    samplers = samplers_for(batch, V)
    tensor = torch.from_numpy(logits)
    out = sample_batch(tensor, samplers)
    probs = sampling_probs(tensor, samplers).numpy()
    assert len(out) == len(batch)
    for i, (row, sampled) in enumerate(zip(batch, out)):
        check_row(logits[i], row, probs[i], sampled.token, sampled.logprob, sampled.top_logprobs)


# --- the properties ------------------------------------------------------------------------------------------

@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches(st.integers(7, 4096)))
def test_sampling_is_total_and_follows_the_rule(case: tuple[np.ndarray, list[Row]]) -> None:
    check_batch(*case)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches(st.integers(7, 70)))
def test_sampling_small_vocabularies(case: tuple[np.ndarray, list[Row]]) -> None:
    check_batch(*case)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches(st.just(262_144), max_rows=2))
def test_sampling_a_gemma3_sized_vocabulary(case: tuple[np.ndarray, list[Row]]) -> None:
    check_batch(*case)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_a_pathological_row_leaves_the_other_rows_as_they_are_alone(data: st.DataObject) -> None:
    vocab = data.draw(st.sampled_from([7, 300, 5000]))
    n = data.draw(st.integers(1, 4))
    seeded = [data.draw(rows(vocab, wild)) for wild in [False] * n + [True]]  # seeded: alone draws as in the batch
    for row in seeded:
        row.params = dataclasses.replace(row.params, seed=data.draw(st.integers(0, 2 ** 31)))
    ordinary, odd = seeded[:n], seeded[n]
    at = data.draw(st.integers(0, n))
    batch = ordinary[:at] + [odd] + ordinary[at:]
    logits = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1))).standard_normal((n + 1, vocab))
    logits = (logits * 3).astype(np.float32)
    logits[at] = data.draw(logits_rows(1, vocab, wild=True))[0]
    together = sample_batch(torch.from_numpy(logits), samplers_for(batch, vocab))
    probs = sampling_probs(torch.from_numpy(logits), samplers_for(batch, vocab))
    for i, row in enumerate(batch):
        if i == at:
            continue
        alone = torch.from_numpy(logits[i:i + 1].copy())
        got = sample_batch(alone, samplers_for([row], vocab))[0]
        assert (got.token, got.logprob, got.top_logprobs) == (together[i].token, together[i].logprob,
                                                              together[i].top_logprobs)
        assert torch.equal(sampling_probs(alone, samplers_for([row], vocab))[0], probs[i])
