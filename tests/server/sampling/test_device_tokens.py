"""Greedy tokens sampled on the device (async scheduling) are the tokens `sample_batch` picks, odd logits included."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from server.sampling.device_tokens import sample_greedy_on_device
from server.sampling.params import SamplingParams
from server.sampling.sampler import SequenceSampler, sample_batch

VOCAB = 7
# Ties, infinities and NaN are what a safe argmax must get right; a small alphabet makes them frequent.
VALUES = st.sampled_from([0.0, 1.5, -2.0, 3.25, math.inf, -math.inf, math.nan])


def _samplers(rows: int, **params) -> list[SequenceSampler]:
    return [SequenceSampler(SamplingParams(temperature=0, **params), VOCAB, [1, 2]) for _ in range(rows)]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(VALUES, min_size=VOCAB, max_size=VOCAB), min_size=1, max_size=6))
def test_device_greedy_equals_sample_batch(rows: list[list[float]]) -> None:
    logits = torch.tensor(rows, dtype=torch.float32)
    samplers = _samplers(len(rows))
    on_device = sample_greedy_on_device(logits, samplers)
    assert on_device is not None
    assert on_device.collect() == [s.token for s in sample_batch(logits, samplers)]


@pytest.mark.parametrize("params", [dict(logprobs=True), dict(repetition_penalty=1.2), dict(logit_bias={3: 2.0})])
def test_only_plain_greedy_rows_are_sampled_on_the_device(params: dict) -> None:
    """A row with logprobs or something to adjust keeps the general path (None), and so does a sampled row."""
    logits = torch.randn(3, VOCAB)
    assert sample_greedy_on_device(logits, _samplers(2) + _samplers(1, **params)) is None
    sampled = [SequenceSampler(SamplingParams(temperature=0.8, seed=1), VOCAB, [1])]
    assert sample_greedy_on_device(logits[:1], sampled) is None
    assert sample_greedy_on_device(logits, _samplers(3)) is not None
    with pytest.raises(ValueError):
        sample_greedy_on_device(logits, _samplers(2))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_tokens_reach_the_host_from_cuda() -> None:
    logits = torch.randn(64, VOCAB)
    logits[3] = math.nan
    logits[5, 2] = math.inf
    samplers = _samplers(64)
    on_device = sample_greedy_on_device(logits.cuda(), samplers)
    assert on_device.tokens.device.type == "cuda"
    assert on_device.collect() == [s.token for s in sample_batch(logits, samplers)]
