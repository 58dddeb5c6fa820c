"""Verifying drafted tokens against the target model: the standard rejection-sampling rule of speculative decoding.

A speculating row drafted k tokens d1..dk after its last token; one target forward pass gave logits at k + 1
positions (position i predicts the token after d1..di). Each position's distribution p_i is the sampler's own
(server/sampling.py: logit bias, penalties as if d1..di had been generated, min_tokens suppression, temperature,
top-k, top-p, min-p), through `SequenceSampler.lookahead` views, so that no rule is written twice.

- Draft token d_{i+1} is accepted with probability min(1, p_i(d) / q_i(d)), where q_i is the draft's distribution;
  a token proposed deterministically (prompt lookup, a draft model's argmax) has q_i(d) = 1, so the test is
  u < p_i(d).
- At the first rejection the row's token is drawn from max(0, p_i - q_i) renormalised (for a point mass: p_i with
  d removed); when all k are accepted, a bonus token is drawn from p_k.

A grammar-constrained row verifies each position under its grammar's mask there (`DraftCheck.allowed`), so a
draft the grammar refuses has p = 0 and is rejected.

Every output token then follows exactly the target's distribution (Leviathan et al. 2023, Chen et al. 2023).
Greedy rows take the target's argmax at each position (`sample_batch`, the same code as without speculation) and
accept while the drafts equal it, so their output is token-identical to decoding without speculation.
Logprobs are the target's raw ones at each emitted position.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .sampling import AllowedTokens, SampledToken, SequenceSampler, chosen_tokens, draw_from, sample_batch, \
    sampling_probs


@dataclass
class Proposal:
    """A row's drafted tokens and, when they were sampled, the distribution [len(tokens), vocab] each was drawn
    from (None: proposed deterministically)."""

    tokens: list[int]
    probs: torch.Tensor | None = None

    def cut(self, n: int) -> Proposal:
        """The first `n` drafts (a prefix of a proposal is a proposal)."""
        return Proposal(self.tokens[:n], None if self.probs is None else self.probs[:n])


@dataclass
class DraftCheck:
    """One speculating row: its drafted tokens, a sampler view per position (len(drafts) + 1: see
    `SequenceSampler.lookahead`), for drafts sampled from a distribution that distribution [k, vocab], and for a
    grammar-constrained row the tokens its grammar allows at each position (a token bitmask [k + 1, words])."""

    drafts: list[int]
    views: list[SequenceSampler]
    draft_probs: torch.Tensor | None = None  # None: each draft token was proposed deterministically (q = 1)
    allowed: torch.Tensor | None = None


@dataclass
class Verified:
    """The row's new tokens: the accepted drafts, then one token of the target's (with logprobs if asked)."""

    sampled: list[SampledToken]
    accepted: int


def _offsets(checks: Sequence[DraftCheck]) -> list[int]:
    offsets, at = [], 0
    for check in checks:
        if len(check.views) != len(check.drafts) + 1:
            raise ValueError(f"a check of {len(check.drafts)} drafts needs {len(check.drafts) + 1} sampler views, "
                             f"got {len(check.views)}")
        offsets.append(at)
        at += len(check.views)
    return offsets


@torch.no_grad()
def verify_drafts(logits: torch.Tensor, checks: Sequence[DraftCheck]) -> list[Verified]:
    """The outcome of every check; `logits` [sum(k + 1), vocab] holds each check's k + 1 positions, in order."""
    offsets = _offsets(checks)
    total = sum(len(c.views) for c in checks)
    if logits.dim() != 2 or logits.shape[0] != total:
        raise ValueError(f"logits must be [{total}, vocab], got {list(logits.shape)}")
    out: list[Verified | None] = [None] * len(checks)
    greedy = [j for j, c in enumerate(checks) if c.views[0].params.is_greedy()]
    sampled = [j for j, c in enumerate(checks) if not c.views[0].params.is_greedy()]
    if greedy:
        _verify_greedy(logits, checks, offsets, greedy, out)
    if sampled:
        _verify_sampled(logits, checks, offsets, sampled, out)
    return out  # type: ignore[return-value]


def _rows(logits: torch.Tensor, checks: Sequence[DraftCheck], offsets: list[int],
          which: list[int]) -> tuple[torch.Tensor, list[SequenceSampler], AllowedTokens | None]:
    """The logits rows, sampler views and grammar masks of the checks `which`."""
    rows = [offsets[j] + i for j in which for i in range(len(checks[j].views))]
    views = [v for j in which for v in checks[j].views]
    masks, masked, at = [], [], 0
    for j in which:
        if checks[j].allowed is not None:
            masks.append(checks[j].allowed)
            masked += range(at, at + len(checks[j].views))
        at += len(checks[j].views)
    allowed = (torch.cat(masks), masked) if masks else None
    if len(rows) == logits.shape[0]:
        return logits, views, allowed
    return logits.index_select(0, torch.tensor(rows, device=logits.device)), views, allowed


def _verify_greedy(logits: torch.Tensor, checks: Sequence[DraftCheck], offsets: list[int], which: list[int],
                   out: list[Verified | None]) -> None:
    """The target's own greedy token at every position; drafts are accepted while they equal it."""
    x, views, allowed = _rows(logits, checks, offsets, which)
    picked = sample_batch(x, views, allowed)
    at = 0
    for j in which:
        drafts = checks[j].drafts
        accepted = 0
        while accepted < len(drafts) and picked[at + accepted].token == drafts[accepted]:
            accepted += 1
        out[j] = Verified(picked[at:at + accepted + 1], accepted)
        at += len(drafts) + 1


def _verify_sampled(logits: torch.Tensor, checks: Sequence[DraftCheck], offsets: list[int], which: list[int],
                    out: list[Verified | None]) -> None:
    """The rejection-sampling rule over each row's sampling distributions (see the module docstring)."""
    x, views, allowed = _rows(logits, checks, offsets, which)
    probs = sampling_probs(x, views, allowed)  # [rows, vocab], each row the distribution sample_batch draws from
    dev = probs.device
    # p_i(d_{i+1}) of every drafted token, in one gather and one copy to the host.
    starts, at = [], 0
    draft_rows, draft_ids = [], []
    for j in which:
        starts.append(at)
        draft_rows += range(at, at + len(checks[j].drafts))
        draft_ids += checks[j].drafts
        at += len(checks[j].views)
    p_draft = probs[torch.tensor(draft_rows, dtype=torch.long, device=dev),
                    torch.tensor(draft_ids, dtype=torch.long, device=dev)].tolist() if draft_rows else []
    weights, uniforms, ends = [], [], []
    seen = 0
    for j, start in zip(which, starts):
        check = checks[j]
        drafts, q = check.drafts, check.draft_probs
        q_draft = q[torch.arange(len(drafts), device=q.device), torch.tensor(drafts, device=q.device)].tolist() \
            if q is not None and drafts else None
        accepted = 0
        while accepted < len(drafts):
            p = p_draft[seen + accepted]
            ratio = p if q_draft is None else (p / q_draft[accepted] if q_draft[accepted] > 0 else 1.0)
            if check.views[accepted].draw_uniform() < ratio:
                accepted += 1
            else:
                break
        seen += len(drafts)
        row = probs[start + accepted]
        if accepted < len(drafts):  # the residual: what p holds beyond the draft's distribution
            if q is None:
                residual = row.clone()
                residual[drafts[accepted]] = 0
            else:
                residual = (row - q[accepted].to(row)).clamp_(min=0)
            # Only rounding leaves a rejection without residual mass (p(d) within an ulp of 1): then p itself.
            row = residual if bool(residual.sum() > 0) else row
        weights.append(row)
        uniforms.append(check.views[accepted].draw_uniform())
        ends.append((j, start, accepted))
    last = draw_from(torch.stack(weights), torch.tensor(uniforms, dtype=torch.float64)).tolist()
    # Logprobs (the target's raw ones) of every emitted position, in one call.
    rows = [start + i for _, start, accepted in ends for i in range(accepted + 1)]
    tokens = [t for (j, _, accepted), final in zip(ends, last) for t in checks[j].drafts[:accepted] + [final]]
    row_views = [views[r] for r in rows]
    emitted = chosen_tokens(x.index_select(0, torch.tensor(rows, device=x.device)), row_views, tokens)
    at = 0
    for j, _, accepted in ends:
        out[j] = Verified(emitted[at:at + accepted + 1], accepted)
        at += accepted + 1
