"""`DraftModel`: a small model of the target's vocabulary proposing tokens for the target to verify.

The draft has its own Runner on the same device, with its own paged KV cache (and prefix cache). Each speculating
row keeps a draft sequence that mirrors its tokens: a step first brings every row's draft sequence up to its real
tokens (the tokens accepted since, and the target's own; a new row prefills its prompt, mostly from the draft's
prefix cache), which gives each row's first draft token, then decodes the rows together, one batched draft
forward pass per further drafted position. A greedy row drafts the draft's argmax; a sampled row draws its drafts
from the draft's distribution processed by the row's own sampler (bias, penalties, temperature, top-k/p, min-p:
`sampling_probs`), and hands that distribution on for the target's rejection sampling
(server/speculative/rejection.py), which keeps the output exactly the target's either way.

What the target rejects is rolled back in the draft's cache too, when the row next comes to propose.
"""
from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from engine import Runner
from engine.model.batch import StepRow, TokenFeed
from engine.cache.block_manager import PENDING_TOKEN, KVSequence

from server.sampling.sampler import SequenceSampler, draw_from, sampling_probs
from server.speculative.rejection import Proposal

log = logging.getLogger("emberserve.speculative")


def vocabulary_mismatch(target: Runner, draft: Runner) -> str | None:
    """Why `draft` cannot propose tokens for `target` (their vocabularies differ), or None."""
    if draft.is_encoder:
        return f"the draft model {draft.name} is an encoder; a draft must be a decoder"
    if draft.vocab_size != target.vocab_size:
        return (f"the draft model {draft.name} has a vocabulary of {draft.vocab_size} tokens and the target "
                f"{target.name} one of {target.vocab_size}: a draft must share the target's vocabulary")
    a, b = target.tokenizer, draft.tokenizer
    differ = next((i for i in range(target.vocab_size) if a.token_bytes(i) != b.token_bytes(i)), None)
    if differ is not None:
        return (f"the draft model {draft.name} and the target {target.name} differ at token {differ} "
                f"({b.token_bytes(differ)!r} vs {a.token_bytes(differ)!r}): a draft must share the target's "
                "vocabulary")
    return None


@dataclass(eq=False)
class _Mirror:
    seq: KVSequence
    checked: int = 0  # leading tokens known to equal the row's real tokens


class DraftModel:
    """Proposes up to k tokens per row with a draft Runner; keyed by the caller's row objects."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self._rows: dict[object, _Mirror] = {}
        self.last_catch_up = 0  # the most tokens a row's first pass of the last `propose` computed

    def retain(self, keys: Collection[object]) -> None:
        """Free the draft sequences of rows not in `keys` (finished, preempted or failed)."""
        for key in [k for k in self._rows if k not in keys]:
            self.runner.free_sequence(self._rows.pop(key).seq)

    def _drop(self, key: object) -> None:
        mirror = self._rows.pop(key, None)
        if mirror is not None:
            self.runner.free_sequence(mirror.seq)

    def _sync(self, key: object, tokens: Sequence[int]) -> KVSequence:
        """The row's draft sequence holding `tokens`, its computed part cut back to where it still agrees."""
        mirror = self._rows.get(key)
        if mirror is None:
            seq = self.runner.new_sequence(tokens)
            self._rows[key] = _Mirror(seq, seq.num_computed)
            return seq
        seq = mirror.seq
        valid = mirror.checked
        limit = min(seq.num_computed, len(tokens) - 1)  # at least the last real token is computed again
        while valid < limit and seq.tokens[valid] == tokens[valid]:
            valid += 1
        valid = min(valid, limit)
        self.runner.rollback_sequence(seq, valid)
        seq.tokens.extend(tokens[valid:])
        mirror.checked = valid
        return seq

    @torch.inference_mode()
    def propose(self, rows: Sequence[tuple[object, Sequence[int], int, SequenceSampler]]) -> dict[object, Proposal]:
        """Up to k draft tokens for each (key, tokens, k, sampler) row; a row the draft's cache cannot hold now gets
        none."""
        runner, active = self.runner, []
        self.last_catch_up = 0
        samplers = {key: sampler for key, _, _, sampler in rows if not sampler.params.is_greedy()}
        for key, tokens, k, _ in rows:
            k = min(k, self.runner.context_size - len(tokens) + 1)
            if k <= 0:
                continue
            try:
                seq = self._sync(key, tokens)
            except ValueError as e:  # the draft's context or ids refuse the row: it does not speculate
                log.debug("no draft for a row: %s", e)
                continue
            # Every draft step's blocks up front, so no later step of this call runs short.
            if not runner.can_allocate(seq, len(tokens) + k - 1):
                self._drop(key)
                continue
            runner.allocate(seq, len(tokens) + k - 1)
            active.append((key, seq, k))
            self.last_catch_up = max(self.last_catch_up, len(seq.tokens) - seq.num_computed)
        if not active:  # every row paused or refused (or an exploring step): no pass to run
            return {}
        if not samplers and self.runner.tensor_parallel is None:
            return {key: Proposal(tokens) for key, tokens in self._greedy_chain(active).items()}
        drafts: dict[object, list[int]] = {key: [] for key, _, _ in active}
        probs: dict[object, list[torch.Tensor]] = {key: [] for key, _, _ in active if key in samplers}
        step = [StepRow(seq, seq.num_computed, len(seq.tokens)) for _, seq, _ in active]
        while active:
            logits = self.runner.step(step)
            picked = logits.argmax(-1).tolist()
            sampled = [i for i, (key, _, _) in enumerate(active) if key in samplers]
            if sampled:
                # The row's sampler as it will stand at this position: penalising the drafts before it.
                views = [samplers[active[i][0]].lookahead(drafts[active[i][0]])[-1] for i in sampled]
                for view in views:  # min_tokens is the target's business (it rejects early end tokens)
                    view.suppressed = None
                q = sampling_probs(logits[sampled] if len(sampled) < len(active) else logits, views)
                u = torch.tensor([v.draw_uniform() for v in views], dtype=torch.float64)
                for j, (i, token) in enumerate(zip(sampled, draw_from(q, u).tolist())):
                    picked[i] = token
                    probs[active[i][0]].append(q[j])
            going = []
            for (key, seq, k), token in zip(active, picked):
                drafts[key].append(token)
                if len(drafts[key]) < k:
                    seq.tokens.append(token)
                    going.append((key, seq, k))
            active = going
            step = [StepRow(seq, len(seq.tokens) - 1, len(seq.tokens)) for _, seq, _ in active]
        return {key: Proposal(tokens, torch.stack(probs[key]) if key in probs else None)
                for key, tokens in drafts.items()}

    def _greedy_chain(self, active: list[tuple[object, KVSequence, int]]) -> dict[object, list[int]]:
        """Every row's k argmax drafts, each pass reading the previous pass's picks on the device (a TokenFeed, the
        sequences holding PENDING_TOKEN in their place): the passes run back to back and the host takes all the
        tokens once, rather than waiting on the device after each."""
        runner = self.runner
        rows = [StepRow(seq, seq.num_computed, len(seq.tokens)) for _, seq, _ in active]
        picks = [runner.step(rows).argmax(-1)]
        passes = [active]
        while True:
            going = [(i, row) for i, row in enumerate(passes[-1]) if row[2] > len(passes)]
            if not going:
                break
            for _, (_, seq, _) in going:
                seq.tokens.append(PENDING_TOKEN)  # the previous pass's pick, read on the device
            feed = TokenFeed(picks[-1], [i for i, _ in going])
            passes.append([row for _, row in going])
            picks.append(runner.step([StepRow(seq, len(seq.tokens) - 1, len(seq.tokens))
                                      for _, seq, _ in passes[-1]], feed).argmax(-1))
        flat = iter(torch.cat(picks).tolist())  # the one wait for the device
        drafts: dict[object, list[int]] = {key: [] for key, _, _ in active}
        for rows_of_pass in passes:
            for key, _, _ in rows_of_pass:
                drafts[key].append(next(flat))
        for key, seq, k in active:
            if k > 1:  # the placeholders stand for all but the last draft
                seq.tokens[len(seq.tokens) - (k - 1):] = drafts[key][:k - 1]
                runner.commit_sequence(seq)  # blocks that held a placeholder enter the prefix cache now
        return drafts
