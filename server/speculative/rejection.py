"""Verifying drafted tokens against the target model: the standard rejection-sampling rule of speculative decoding.

A speculating row drafted k tokens d1..dk after its last token; one target forward pass gave logits at k + 1
positions (position i predicts the token after d1..di). Each position's distribution p_i is the sampler's own
(server/sampling/sampler.py: logit bias, penalties as if d1..di had been generated, min_tokens suppression, temperature,
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

from server.sampling.sampler import (AllowedTokens, SampledToken, SequenceSampler, chosen_tokens, draw_from,
    sample_batch, sampling_probs)


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
    starts, at, draft_rows, draft_ids = [], 0, [], []
    q_parts, q_index, q_at = [], [], 0  # the draft distributions given, and each drafted token's row in them
    for j in which:
        check = checks[j]
        starts.append(at)
        draft_rows += range(at, at + len(check.drafts))
        draft_ids += check.drafts
        if check.draft_probs is None:
            q_index += [-1] * len(check.drafts)  # a point mass: q(d) = 1
        else:
            q_parts.append(check.draft_probs.to(probs))
            q_index += range(q_at, q_at + len(check.drafts))
            q_at += len(check.drafts)
        at += len(check.views)
    # p_i(d_{i+1}) and q_i(d_{i+1}) of every drafted token, in one gather each and one copy to the host.
    ids_t = torch.tensor(draft_ids, dtype=torch.long, device=dev)
    p_draft = probs[torch.tensor(draft_rows, dtype=torch.long, device=dev), ids_t].tolist() if draft_ids else []
    q_all = torch.cat(q_parts) if q_parts else None
    q_draft = [-1.0] * len(draft_ids)
    if q_all is not None:
        given = [i for i, r in enumerate(q_index) if r >= 0]
        values = q_all[torch.tensor([q_index[i] for i in given], device=dev), ids_t[given]].tolist()
        for i, v in zip(given, values):
            q_draft[i] = v
    final_rows, rejected, finals_u = [], [], []
    seen = 0
    for j, start in zip(which, starts):
        check = checks[j]
        k = len(check.drafts)
        # One uniform per drafted position and one for the row's own token, from the row's generator.
        u = torch.rand(k + 1, generator=check.views[0].generator, dtype=torch.float64).tolist()
        accepted = 0
        while accepted < k:
            p, q = p_draft[seen + accepted], q_draft[seen + accepted]
            # min(1, p / q); q < 0 marks a point mass (q = 1); q = 0 (a draft its own distribution excludes,
            # only by rounding) keeps the token exactly when the target allows it.
            ratio = p if q < 0 else p / q if q > 0 else float(p > 0)
            if u[accepted] >= ratio:
                break
            accepted += 1
        final_rows.append(start + accepted)
        rejected.append(seen + accepted if accepted < k else -1)  # the rejected draft's index, if any
        finals_u.append(u[k])
        seen += k
        out[j] = Verified([], accepted)
    # Each row's own token: from p at the first rejection, less the draft's distribution (the residual
    # max(0, p - q), for a point mass p without the draft token), or from p after all k were accepted.
    target = probs.index_select(0, torch.tensor(final_rows, device=dev))
    weights = target.clone()
    point = [(r, draft_ids[d]) for r, d in enumerate(rejected) if d >= 0 and q_index[d] < 0]
    if point:  # p without the rejected draft token
        weights[torch.tensor([r for r, _ in point], device=dev), torch.tensor([t for _, t in point], device=dev)] = 0
    sampled = [(r, q_index[d]) for r, d in enumerate(rejected) if d >= 0 and q_index[d] >= 0]
    if sampled:  # max(0, p - q)
        r_t = torch.tensor([r for r, _ in sampled], device=dev)
        q_rows = q_all.index_select(0, torch.tensor([i for _, i in sampled], device=dev))
        weights.index_copy_(0, r_t, (weights.index_select(0, r_t) - q_rows).clamp_(min=0))
    # Only rounding leaves a rejection without residual mass (p(d) within an ulp of 1): then p itself.
    empty = weights.sum(-1, keepdim=True) <= 0
    weights = torch.where(empty, target, weights)
    last = draw_from(weights, torch.tensor(finals_u, dtype=torch.float64)).tolist()
    # Logprobs (the target's raw ones) of every emitted position, in one call.
    rows = [start + i for start, j in zip(starts, which) for i in range(out[j].accepted + 1)]
    tokens = [t for j, final in zip(which, last) for t in checks[j].drafts[:out[j].accepted] + [final]]
    emitted = chosen_tokens(x.index_select(0, torch.tensor(rows, device=x.device)), [views[r] for r in rows], tokens)
    at = 0
    for j in which:
        n = out[j].accepted + 1
        out[j].sampled = emitted[at:at + n]
        at += n
