"""`Speculator`: which decoding rows speculate each step, how many tokens they draft, and the acceptance figures.

The scheduler asks it for draft tokens before a step (prompt lookup, server/speculative/ngram.py, or a draft model,
server/speculative/draft_model.py), verifies them in the step's one target forward pass (server/speculative/rejection.py), and
tells it how many were accepted.

Adaptive: each row keeps a moving average of the fraction of its drafts that were accepted. A row drafts
k = ceil(K x that rate) tokens (so fewer when few are accepted), and one whose rate falls below the break-even rate
stops speculating for a while, longer each time it fails again; text that does not copy its context then decodes
as without speculation, but for an occasional probe. The break-even rate is measured (server/speculative/cost.py:
what a drafted token costs against what a decoded one makes, per batch size), `PAUSE_BELOW` until it is; seeded
sampled rows always use `PAUSE_BELOW`, since their output must not depend on timing. With `disable_by_batch_size`,
no row speculates in a step of more decoding rows than that.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from server.config.settings import SpeculativeMethod
from server.speculative.draft_model import DraftModel
from server.speculative.ngram import NgramIndex
from server.sampling.sampler import SequenceSampler
from server.speculative.cost import StepCost
from server.speculative.rejection import Proposal

log = logging.getLogger("emberserve.speculative")
RATE_WEIGHT = 0.3  # weight of the latest step in a row's moving acceptance rate
PAUSE_BELOW = 0.25  # a row whose rate falls below this stops speculating for a while (until measured)
MIN_PAUSE_BELOW = 0.1  # the measured break-even rate, however low, is not trusted below this
FIRST_PAUSE, LONGEST_PAUSE = 8, 128  # steps; doubled on every pause in a row
PROBE_RATE = 0.4  # where the rate starts again after a pause: one more failed probe pauses it again


@dataclass(frozen=True)
class SpeculativeConfig:
    method: SpeculativeMethod
    num_tokens: int = 4  # K: most tokens a row drafts per step
    ngram_min: int = 1
    ngram_max: int = 4
    disable_by_batch_size: int | None = None
    measure: bool = True  # pause rows below the measured break-even rate (server/speculative/cost.py)


@dataclass
class _RowState:
    index: NgramIndex | None
    rate: float = 1.0
    pause: int = 0
    next_pause: int = FIRST_PAUSE
    pause_below: float = PAUSE_BELOW  # the break-even rate when the row last drafted

    def draft_length(self, most: int) -> int:
        return max(1, min(most, math.ceil(most * self.rate)))

    def record(self, drafted: int, accepted: int) -> None:
        self.rate += RATE_WEIGHT * (accepted / drafted - self.rate)
        if self.rate < self.pause_below:
            self.pause, self.next_pause = self.next_pause, min(2 * self.next_pause, LONGEST_PAUSE)
            self.rate = max(PROBE_RATE, self.pause_below + PROBE_RATE - PAUSE_BELOW)
        elif self.rate >= 2 * self.pause_below:
            self.next_pause = FIRST_PAUSE


@dataclass
class SpeculationStats:
    """vLLM's spec_decode counters: drafts (rows that speculated, once per step), drafted and accepted tokens, and
    accepted tokens by draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)


class Speculator:
    """Draft tokens for a scheduler's decoding rows (keyed by the scheduler's row objects) and their figures."""

    def __init__(self, config: SpeculativeConfig, draft: DraftModel | None = None) -> None:
        if (config.method == "draft") != (draft is not None):
            raise ValueError("a draft model is needed for method 'draft', and only for it")
        if config.num_tokens < 1:
            raise ValueError(f"num_tokens must be at least 1, got {config.num_tokens}")
        self.config, self.draft = config, draft
        self._rows: dict[object, _RowState] = {}
        self.stats = SpeculationStats(accepted_per_position=[0] * config.num_tokens)
        self.cost = StepCost() if config.measure else None
        self._timed = True  # whether the last step's timing measures the cost (see observe_step)
        self._drafted = False  # whether the last step drafted

    def retain(self, keys: Collection[object]) -> None:
        """Forget the rows not in `keys` (they finished, failed or were preempted)."""
        keys = set(keys)
        for key in [k for k in self._rows if k not in keys]:
            del self._rows[key]
        if self.draft is not None:
            self.draft.retain(keys)

    def propose(self, rows: Sequence[tuple[object, Sequence[int], int, SequenceSampler]]) -> dict[object, Proposal]:
        """Draft tokens for the (key, tokens, at most, sampler) rows that speculate this step: `tokens` is the row's
        whole sequence so far, `at most` how many it may draft (its remaining max_tokens and context), `sampler`
        its sampling (a draft model samples its drafts the same way)."""
        self._timed = True
        proposals = self._propose(rows)
        if not proposals and self._drafted:
            # Verifying drafts waits for the device, so the plain step after one runs with no step of its own
            # overlapping it: slower than plain decoding runs, which is what drafting is weighed against.
            self._timed = False
        self._drafted = bool(proposals)
        return proposals

    def _propose(self, rows: Sequence[tuple[object, Sequence[int], int, SequenceSampler]]) -> dict[object, Proposal]:
        cfg = self.config
        if not rows or cfg.disable_by_batch_size is not None and len(rows) > cfg.disable_by_batch_size:
            return {}
        # Seeded sampled rows keep the fixed rule: how a row speculates changes how it consumes its random numbers,
        # and a seed must repeat its output, not depend on the timing of the steps.
        explore = self.cost is not None and self.cost.explore(len(rows))
        measured = self.cost.break_even(len(rows)) if self.cost is not None else None
        # Where even certain acceptance would not pay, timed rows draft only in the bucket's probing steps (all of
        # them, paused or not), which keep the cost measured.
        futile = measured is not None and measured >= 1
        probe = futile and self.cost.probing(len(rows))
        wanted: list[tuple[object, Sequence[int], int, SequenceSampler]] = []
        for key, tokens, most, sampler in rows:
            timed = sampler.params.seed is None or sampler.params.is_greedy()
            if timed and (explore or futile and not probe):
                continue
            state = self._rows.get(key)
            if state is None:
                index = NgramIndex(cfg.ngram_min, cfg.ngram_max) if cfg.method == "ngram" else None
                state = self._rows[key] = _RowState(index)
            if state.pause > 0 and not (probe and timed):
                state.pause -= 1
                continue
            state.pause_below = max(MIN_PAUSE_BELOW, measured) if timed and measured is not None else PAUSE_BELOW
            k = min(state.draft_length(cfg.num_tokens), most)
            if k > 0:
                wanted.append((key, tokens, k, sampler))
        if not wanted:
            return {}
        if self.draft is not None:
            try:
                proposals = self.draft.propose(wanted)
            except Exception:  # the draft is an optimisation: a failing one must not fail the target's requests
                log.exception("the draft model failed; this step does not speculate")
                self.draft.retain(())
                return {}
            # A draft that prefilled a prompt or caught up after a pause paid a one-off cost, not a draft's.
            self._timed = self.draft.last_catch_up <= cfg.num_tokens + 1
        else:
            proposals = {key: Proposal(self._rows[key].index.propose(tokens, k)) for key, tokens, k, _ in wanted}
        return {key: p for key, p in proposals.items() if p.tokens}

    def observe_step(self, rows: int, drafted: int, seconds: float) -> None:
        """A decode-only step: `rows` sequences, the tokens they drafted, and how long it took (from proposing to
        handing the tokens on); a step whose draft model caught a row up, or a plain one right after drafting, says
        nothing about the cost."""
        if self.cost is not None and self._timed:
            self.cost.observe(rows, drafted, seconds)

    def record(self, key: object, drafted: int, accepted: int) -> None:
        """A row's verified step: `accepted` of its `drafted` tokens were kept."""
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += drafted
        stats.num_accepted_tokens += accepted
        for i in range(accepted):
            stats.accepted_per_position[i] += 1
        state = self._rows.get(key)
        if state is not None:
            state.record(drafted, accepted)
