"""`token_logprobs`: raw log-probabilities of given tokens and of each row's most likely ones, computed so that a
large vocabulary or a dominant token keeps float64's digits (the one logprob computation: sampled and prompt)."""
from __future__ import annotations

import math

import torch


@torch.no_grad()
def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor,
                   top_n: int = 0) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """Of each row of `logits` [R, vocab] (any float dtype): the logprob of its token `token_ids` [R] (int64, on the
    logits' device), and its `top_n` most likely tokens with theirs (most likely first; at most the vocabulary).

    The model's raw distribution: NaN counts as -inf and +inf as the largest float32, as log_softmax has it; a row
    without a finite logit has logprobs -inf. Not torch's log_softmax, whose CPU float32 sum drifts with the
    vocabulary (2.7e-4 off for a 262,144-token row): shifted by the row's largest logit (exact for the top tokens,
    however large), then normalised by log1p of the other tokens' summed share, so that a dominant token's logprob
    near 0 keeps its digits (log of a float32 sum near 1 would not). Only the asked tokens' logprobs are taken."""
    raw = logits.float().nan_to_num(nan=-math.inf, neginf=-math.inf)
    top, best = raw.max(-1, keepdim=True)
    raw = raw - top
    norm = raw.exp().scatter_(1, best, 0.0).sum(-1, keepdim=True).log1p()
    chosen = (raw.gather(1, token_ids[:, None]) - norm)[:, 0]
    # Only a row without a finite logit has NaN here (-inf - -inf).
    chosen_list = chosen.nan_to_num(nan=-math.inf).tolist()
    n = min(top_n, raw.shape[1])
    if n <= 0:
        return chosen_list, [[] for _ in chosen_list]
    top_vals, top_ids = raw.topk(n, -1)
    top_vals -= norm
    vals, ids = top_vals.nan_to_num(nan=-math.inf).tolist(), top_ids.tolist()
    return chosen_list, [list(zip(i, v)) for i, v in zip(ids, vals)]
