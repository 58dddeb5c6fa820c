"""The scheduler's side of speculative decoding: which running choices draft this step (`propose_drafts`), the
checks their drafts are verified by (`draft_check`), and how a decode-only step went (`observe_decode_step`)."""
from __future__ import annotations

import torch

from engine.model.batch import StepRow

from server.grammar.compiler import fill_draft_bitmasks
from server.grammar.token_bitmask import allocate_bitmask
from server.scheduling.sequence import SequenceState
from server.speculative.rejection import DraftCheck, Proposal
from server.speculative.speculator import Speculator


def propose_drafts(spec: Speculator, running: list[SequenceState],
                   context_size: int) -> dict[SequenceState, Proposal]:
    """Draft tokens of the decoding choices among `running` that speculate this step."""
    spec.retain(running)
    rows = []
    for seq in running:
        if seq.choice is None or seq.kv.num_pending != 1 or seq.gen.backlogged:
            continue
        # The step makes one token anyway; drafts stay within max_tokens and the context (the tokens made so far
        # counted from the sequence: its stop checker may not have seen the last one yet, see defer_text).
        most = context_size - len(seq.kv.tokens)
        if seq.gen.max_tokens is not None:
            most = min(most, seq.gen.max_tokens - (len(seq.kv.tokens) - len(seq.gen.prompt_ids)) - 1)
        if most > 0:
            rows.append((seq, seq.kv.tokens, most, seq.sampler))
    return spec.propose(rows)  # type: ignore[return-value]


def draft_check(seq: SequenceState, drafts: Proposal, ends: torch.Tensor | None, vocab_size: int) -> DraftCheck:
    """What the sequence's drafts are verified against: its sampler at each drafted position (end tokens `ends`
    kept out until min_tokens) and its grammar's masks."""
    views = seq.sampler.lookahead(drafts.tokens)
    for i, view in enumerate(views):  # min_tokens: position i makes the choice's token num_tokens + i + 1
        early_end = seq.stopper.num_tokens + i < seq.gen.min_tokens and not seq.gen.ignore_eos
        view.suppressed = ends if early_end else None
    allowed = None
    if seq.matcher is not None:
        allowed = allocate_bitmask(len(views), vocab_size)
        fill_draft_bitmasks(seq.matcher, drafts.tokens, allowed)
    return DraftCheck(drafts.tokens, views, drafts.probs, allowed)


def observe_decode_step(spec: Speculator, seqs: list[SequenceState], rows: list[StepRow],
                        drafts: dict[SequenceState, Proposal], seconds: float) -> None:
    """Tell the speculator how a decode-only step went (a step with prompt chunks says nothing about it)."""
    for seq, row in zip(seqs, rows):
        proposal = drafts.get(seq)
        if seq.choice is None or row.end - row.start != 1 + (len(proposal.tokens) if proposal else 0):
            return
    spec.observe_step(len(seqs), sum(len(d.tokens) for d in drafts.values()), seconds)
