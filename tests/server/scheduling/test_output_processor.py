"""The scheduler's output processor (server/scheduling/output_processor.py): echoed prompt logprobs."""
from __future__ import annotations

import pytest
import torch

from engine.cache.block_manager import KVSequence
from engine.model.batch import StepRow
from server.sampling.params import SamplingParams
from server.scheduling.generation import Generation
from server.scheduling.output_processor import OutputProcessor
from server.scheduling.sequence import SequenceState


def test_echoed_prompt_logprobs_of_a_large_vocabulary_are_the_float64_ones() -> None:
    """Prompt logprobs over gemma3's 262,144-token vocabulary, as the sampled ones
    (tests/server/sampling/test_sampling.py): one logit of 2 among 262,143 zeros, where torch's CPU float32 log_softmax is
    2.7e-4 off, and a dominant token whose logprob is near 0 (-5e-4), whose digits the log of a float32 sum near 1
    loses; each the float64 logprob to 1e-6 of its size, with its top alternatives."""
    vocab = 262_144
    prompt = [7, 0, 5, 9]
    logits = torch.zeros(len(prompt), vocab)
    logits[0, 0] = 2.0    # predicts prompt[1] = 0: the one logit of 2
    logits[1, 5] = 20.0   # predicts prompt[2] = 5: dominant, logprob near 0
    logits[2, 3] = 1.0    # predicts prompt[3] = 9: one of the flat zeros
    gen = Generation(prompt_ids=prompt, params=SamplingParams(temperature=0), max_tokens=1, prompt_logprobs=2,
                     loop=None)
    seq = SequenceState(gen, KVSequence(list(prompt)))
    OutputProcessor().collect_prompt_logprobs(seq, StepRow(seq.kv, 0, len(prompt), "all"), logits)
    expected = torch.log_softmax(logits.double(), -1)
    entries = seq.prompt_logprobs
    assert len(entries) == len(prompt) and entries[0] is None
    for i, entry in enumerate(entries[1:]):
        assert entry.token == prompt[i + 1]
        assert entry.logprob == pytest.approx(expected[i, prompt[i + 1]].item(), rel=1e-6), i
        top = expected[i].topk(2)
        assert [t for t, _ in entry.top][0] == top.indices[0].item()
        assert [v for _, v in entry.top] == pytest.approx(top.values.tolist(), rel=1e-6), i
