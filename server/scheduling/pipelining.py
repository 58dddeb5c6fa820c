"""A step's host work run beside the device's: grammar masks filled during the forward pass (`EarlyMasks`), and a
step's tokens left on the device for the next step to read (`Inflight`, async scheduling)."""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from engine.model.batch import StepRow, TokenFeed

from server.grammar.compiler import GrammarMatcher, fill_bitmasks
from server.grammar.token_bitmask import allocate_bitmask
from server.sampling.device_tokens import DeviceTokens
from server.scheduling.sequence import SequenceState


@dataclass
class EarlyMasks:
    """Bitmasks being filled while the forward pass runs: the sequences, the bitmask (row i: seqs[i]), the fill."""

    seqs: list[SequenceState]
    bitmask: torch.Tensor
    future: Future
    index: dict[int, int] = field(init=False)

    def __post_init__(self) -> None:
        self.index = {id(s): i for i, s in enumerate(self.seqs)}

    def row(self, seq: SequenceState) -> int | None:
        """The sequence's row, by identity: a sequence that left during the pass (failed, cancelled) may be freed
        and its id() reused by a choice forked after it, which must not take its mask."""
        i = self.index.get(id(seq))
        return i if i is not None and self.seqs[i] is seq else None


def start_masks(due: list[SequenceState], pool: ThreadPoolExecutor, vocab_size: int) -> EarlyMasks | None:
    """Start filling, on `pool` while the forward pass runs, the bitmasks of the grammar-constrained sequences
    `due` (whose next token this step samples): their matchers are final (the last step advanced them), and
    llguidance fills masks with the GIL released, so a constrained batch is not serialised behind them."""
    if not due:
        return None
    bitmask = allocate_bitmask(len(due), vocab_size)
    future = pool.submit(fill_bitmasks, [s.matcher for s in due], bitmask)
    return EarlyMasks(due, bitmask, future)


def grammar_masks(seqs: list[SequenceState], early: EarlyMasks | None,
                  vocab_size: int) -> tuple[torch.Tensor, list[int]] | None:
    """The token bitmask of the grammar-constrained rows among `seqs`, and their positions: the rows filled early
    (`start_masks`) as they are, the rest (choices just forked) now."""
    rows = [i for i, s in enumerate(seqs) if s.matcher is not None]
    if not rows:
        return None
    if early is not None:
        early.future.result()
    bitmask = allocate_bitmask(len(rows), vocab_size)
    late: list[tuple[int, GrammarMatcher]] = []
    for j, i in enumerate(rows):
        k = None if early is None else early.row(seqs[i])
        if k is None:
            late.append((j, seqs[i].matcher))
        else:
            bitmask[j] = early.bitmask[k]
    for j, matcher in late:
        matcher.fill_bitmask(bitmask, j)
    return bitmask, rows


@dataclass(eq=False)
class Inflight:
    """A step's tokens still on their way to the host (async scheduling): the sequences that sampled them, in the
    order of `tokens`, and where each one's PENDING_TOKEN stands in its sequence."""

    seqs: list[SequenceState]
    tokens: DeviceTokens
    positions: list[int]
    interval: int  # auto_stream_interval of the step that sampled them
    index: dict[SequenceState, int] = field(init=False)

    def __post_init__(self) -> None:
        self.index = {s: i for i, s in enumerate(self.seqs)}

    def feed(self, seqs: list[SequenceState], rows: list[StepRow]) -> TokenFeed | None:
        """The rows whose token is on its way: the step reads it on the device."""
        sources = []
        for seq, row in zip(seqs, rows):
            i = self.index.get(seq, -1)
            if i >= 0 and (row.start != self.positions[i] or row.end != row.start + 1):
                raise RuntimeError(f"a row [{row.start}, {row.end}) holds a token still on its way at "
                                   f"{self.positions[i]}")
            sources.append(i)
        return TokenFeed(self.tokens.tokens, sources) if any(s >= 0 for s in sources) else None
