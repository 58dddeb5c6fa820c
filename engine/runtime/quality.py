"""How far a (quantized) runner drifts from a reference runner: top-1 agreement and perplexity, teacher-forced."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.runtime.runner import Runner


@dataclass(frozen=True)
class TextScore:
    """One runner on one token sequence: its next-token predictions and the log-likelihood of the text."""

    top1: torch.Tensor   # [T - 1] argmax at every position but the last
    nll: torch.Tensor    # [T - 1] negative log-likelihood of each actual next token

    @property
    def perplexity(self) -> float:
        return math.exp(float(self.nll.mean()))


def score_text(runner: Runner, ids: Sequence[int]) -> TextScore:
    """Teacher-forced predictions over `ids` from all-position logits (one forward pass)."""
    logits = runner.predict_logits(list(ids))[:-1].float()
    targets = torch.tensor(ids[1:], dtype=torch.long)
    nll = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
    return TextScore(top1=logits.argmax(-1), nll=nll)


@dataclass(frozen=True)
class Agreement:
    top1_agreement: float      # fraction of positions where both runners predict the same next token
    perplexity: float          # the candidate's perplexity on the texts
    reference_perplexity: float
    positions: int

    @property
    def perplexity_ratio(self) -> float:
        return self.perplexity / self.reference_perplexity


def agreement(got: Sequence[TextScore], want: Sequence[TextScore]) -> Agreement:
    """Top-1 agreement and perplexities of a candidate's scores `got` against a reference's `want`, text by text."""
    same, total, nll, ref_nll = 0, 0, 0.0, 0.0
    for g, w in zip(got, want, strict=True):
        same += int((g.top1 == w.top1).sum())
        total += len(g.top1)
        nll += float(g.nll.sum())
        ref_nll += float(w.nll.sum())
    return Agreement(same / total, math.exp(nll / total), math.exp(ref_nll / total), total)


def compare(candidate: Runner, reference: Runner, texts: Sequence[Sequence[int]]) -> Agreement:
    """Top-1 agreement and perplexities of `candidate` against `reference` over all positions of `texts`."""
    return agreement([score_text(candidate, ids) for ids in texts], [score_text(reference, ids) for ids in texts])
