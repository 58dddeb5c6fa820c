"""`Speculator`: which decoding rows speculate each step, how many tokens they draft, and the acceptance figures.

The scheduler asks it for draft tokens before a step (prompt lookup, server/ngram.py, or a draft model,
server/draft_model.py), verifies them in the step's one target forward pass (server/speculative_sampling.py), and
tells it how many were accepted.

Adaptive: each row keeps a moving average of the fraction of its drafts that were accepted. A row drafts
k = ceil(K x that rate) tokens (so fewer when few are accepted), and one whose rate falls below `PAUSE_BELOW`
stops speculating for a while, longer each time it fails again; text that does not copy its context then decodes
as without speculation, but for an occasional probe.

And measured (`StepThroughput`): verifying drafts is cheap only while a pass is dominated by reading the weights;
in a big batch on a CPU it costs nearly what decoding the tokens would. So the tokens per second of decode-only
steps with and without drafts are kept apart per batch size, and speculation is off while it is the slower of the
two, but for one step in `EXPLORE_EVERY` that measures the other way again (seeded sampled rows excepted: their
output must not depend on timing). With `disable_by_batch_size`, no row speculates in a step of more decoding rows
than that.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Literal

from .draft_model import DraftModel
from .ngram import NgramIndex
from .sampling import SequenceSampler
from .speculative_sampling import Proposal

log = logging.getLogger("emberserve.speculative")
SpeculativeMethod = Literal["ngram", "draft"]
RATE_WEIGHT = 0.3  # weight of the latest step in a row's moving acceptance rate
PAUSE_BELOW = 0.25  # a row whose rate falls below this stops speculating for a while
FIRST_PAUSE, LONGEST_PAUSE = 8, 128  # steps; doubled on every pause in a row
PROBE_RATE = 0.4  # where the rate starts again after a pause: one more failed probe pauses it again


EXPLORE_EVERY = 32  # steps per batch size: one of them speculates the other way than the faster one
THROUGHPUT_WEIGHT = 0.2


@dataclass(frozen=True)
class SpeculativeConfig:
    method: SpeculativeMethod
    num_tokens: int = 4  # K: most tokens a row drafts per step
    ngram_min: int = 1
    ngram_max: int = 4
    disable_by_batch_size: int | None = None
    measure: bool = True  # turn speculation off while steps with drafts make fewer tokens per second


class StepThroughput:
    """Tokens per second of decode-only steps with and without drafts, per batch-size bucket (1, 2, 3-4, 5-8, ...),
    as moving averages; `allows` says whether a step of that many rows should speculate."""

    def __init__(self) -> None:
        self._rates: dict[int, list[float | None]] = {}  # bucket -> [without drafts, with drafts]
        self._steps: dict[int, int] = {}

    @staticmethod
    def _bucket(rows: int) -> int:
        return max(rows - 1, 0).bit_length()

    def allows(self, rows: int) -> bool:
        bucket = self._bucket(rows)
        plain, drafted = self._rates.get(bucket, [None, None])
        faster = drafted is None or plain is None or drafted >= plain
        self._steps[bucket] = self._steps.get(bucket, 0) + 1
        return faster != (self._steps[bucket] % EXPLORE_EVERY == 0)

    def observe(self, rows: int, drafted: bool, tokens: int, seconds: float) -> None:
        """A decode-only step of `rows` sequences made `tokens` tokens in `seconds`."""
        if seconds <= 0:
            return
        rates = self._rates.setdefault(self._bucket(rows), [None, None])
        rate, old = tokens / seconds, rates[drafted]
        rates[drafted] = rate if old is None else old + THROUGHPUT_WEIGHT * (rate - old)


@dataclass
class _RowState:
    index: NgramIndex | None
    rate: float = 1.0
    pause: int = 0
    next_pause: int = FIRST_PAUSE

    def draft_length(self, most: int) -> int:
        return max(1, min(most, math.ceil(most * self.rate)))

    def record(self, drafted: int, accepted: int) -> None:
        self.rate += RATE_WEIGHT * (accepted / drafted - self.rate)
        if self.rate < PAUSE_BELOW:
            self.pause, self.next_pause = self.next_pause, min(2 * self.next_pause, LONGEST_PAUSE)
            self.rate = PROBE_RATE
        elif self.rate >= 2 * PAUSE_BELOW:
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
        self.throughput = StepThroughput() if config.measure else None

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
        cfg = self.config
        if not rows or cfg.disable_by_batch_size is not None and len(rows) > cfg.disable_by_batch_size:
            return {}
        # Seeded sampled rows are exempt from the measured switch: how a row speculates changes how it consumes
        # its random numbers, and a seed must repeat its output, not depend on the timing of other steps.
        measured_off = self.throughput is not None and not self.throughput.allows(len(rows))
        wanted: list[tuple[object, Sequence[int], int, SequenceSampler]] = []
        for key, tokens, most, sampler in rows:
            if measured_off and (sampler.params.seed is None or sampler.params.is_greedy()):
                continue
            state = self._rows.get(key)
            if state is None:
                index = NgramIndex(cfg.ngram_min, cfg.ngram_max) if cfg.method == "ngram" else None
                state = self._rows[key] = _RowState(index)
            if state.pause > 0:
                state.pause -= 1
                continue
            k = min(state.draft_length(cfg.num_tokens), most)
            if k > 0:
                wanted.append((key, tokens, k, sampler))
        if self.draft is not None:
            try:
                proposals = self.draft.propose(wanted)
            except Exception:  # the draft is an optimisation: a failing one must not fail the target's requests
                log.exception("the draft model failed; this step does not speculate")
                self.draft.retain(())
                return {}
        else:
            proposals = {key: Proposal(self._rows[key].index.propose(tokens, k)) for key, tokens, k, _ in wanted}
        return {key: p for key, p in proposals.items() if p.tokens}

    def observe_step(self, rows: int, drafted: bool, tokens: int, seconds: float) -> None:
        """A decode-only step: `rows` sequences, whether any drafted, the tokens it made and how long it took
        (from proposing to handing the tokens on)."""
        if self.throughput is not None:
            self.throughput.observe(rows, drafted, tokens, seconds)

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
