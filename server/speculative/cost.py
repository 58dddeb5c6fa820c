"""`StepCost`: what a drafted token costs in the target's forward pass, measured, and the acceptance rate below
which drafting does not pay.

A decode-only step of R rows takes t0 seconds without drafts, and each drafted token adds c seconds (the model
computes it like any other). A row whose drafts are accepted at rate a makes a·d more tokens for its d drafts, so
drafting raises the step's R / t0 tokens per second exactly when a > c·R / t0: the break-even rate. While a pass is
dominated by reading the weights (one stream; a GPU) c is small and a modest acceptance pays; in a big batch on a
CPU a drafted token costs about what a decoded one does (c ~ t0 / R) and only near-certain drafts pay.

t0 and c are moving averages per batch-size bucket (1, 2, 3-4, 5-8, ...) of the steps as the scheduler times them
(from proposing to handing the tokens on, so a draft model's own passes count in c). Two steps in `EXPLORE_EVERY`
of a bucket run without drafts, so that t0 stays measured even where every row always drafts: the second one
measures it (the Speculator does not time the first, which refills the pipeline of overlapped steps that a
verification emptied). Where c ≥ t0 / R
no acceptance pays (a draft model nearly as slow as the target: an int4 copy on a GPU, whose decode step is
launch-bound); such a bucket drafts only in `probing` steps, two in `PROBE_EVERY`, which keep c measured.
"""
from __future__ import annotations

EXPLORE_EVERY = 64
PROBE_EVERY = 128  # steps of a bucket where nothing pays; in two of them rows draft (the first catches a draft up)
WEIGHT = 0.2  # of the latest step in the moving averages


def _bucket(rows: int) -> int:
    return max(rows - 1, 0).bit_length()


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + WEIGHT * (new - old)


class StepCost:
    """Measured t0 and c per batch size, and the break-even acceptance rate they imply."""

    def __init__(self) -> None:
        self._plain: dict[int, float] = {}      # bucket -> seconds of a step without drafts
        self._per_draft: dict[int, float] = {}  # bucket -> seconds each drafted token adds
        self._steps: dict[int, int] = {}

    def explore(self, rows: int) -> bool:
        """Whether this step of `rows` decoding rows should run without drafts, to measure t0 (two steps in a row)."""
        bucket = _bucket(rows)
        self._steps[bucket] = self._steps.get(bucket, 0) + 1
        return self._steps[bucket] % EXPLORE_EVERY in (EXPLORE_EVERY - 1, 0)

    def probing(self, rows: int) -> bool:
        """Whether this step (after `explore` counted it) is one of a bucket's two probes in PROBE_EVERY."""
        return 1 <= self._steps.get(_bucket(rows), 0) % PROBE_EVERY <= 2

    def break_even(self, rows: int) -> float | None:
        """The acceptance rate above which a row's drafts pay in a step of `rows` rows; None until measured."""
        bucket = _bucket(rows)
        plain, per_draft = self._plain.get(bucket), self._per_draft.get(bucket)
        if plain is None or per_draft is None or plain <= 0:
            return None
        return max(per_draft, 0.0) * rows / plain

    def observe(self, rows: int, drafted: int, seconds: float) -> None:
        """A decode-only step of `rows` rows with `drafted` drafted tokens took `seconds`."""
        bucket = _bucket(rows)
        if drafted == 0:
            self._plain[bucket] = _average(self._plain.get(bucket), seconds)
        elif bucket in self._plain:
            self._per_draft[bucket] = _average(self._per_draft.get(bucket), (seconds - self._plain[bucket]) / drafted)
