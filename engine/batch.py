"""`ForwardBatch`: the rows of one forward pass (prefill chunks and decode tokens of many sequences), flattened.

All new tokens of all rows form one [N] sequence for the projections and MLPs, the bulk of the work. Attention
is per row: rows with one new token form one batched decode group reading their keys through the block tables;
each longer chunk (a prefill) attends on its own.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .block_manager import KVSequence


@dataclass(frozen=True)
class StepRow:
    """Compute tokens [start, end) of `seq`; `logits`: "last" (next-token logits), "all" (every position), "none"."""

    seq: KVSequence
    start: int
    end: int
    logits: str = "last"


@dataclass
class DecodeGroup:
    token_index: torch.Tensor          # [Bd] where the rows' tokens sit in the flat batch
    key_blocks: torch.Tensor           # [Bd, nb] cache blocks holding each row's keys (padded with its first block)
    full_mask: torch.Tensor | None     # [Bd, 1, 1, nb * block] bool; None when every slot of every row is a key
    sliding_mask: torch.Tensor | None
    whole_batch: bool = False          # the group is every token of the batch, in order (pure decode step)


@dataclass
class PrefillRow:
    begin: int                         # the chunk's tokens are [begin, end) of the flat batch
    end: int
    key_blocks: torch.Tensor | None    # cache blocks of keys 0..last position; None: a fresh sequence (own k, v)
    full_mask: torch.Tensor | None     # [1, 1, T, nb * block] bool; None: plain causal
    sliding_mask: torch.Tensor | None


@dataclass
class ForwardBatch:
    ids: torch.Tensor                  # [N]
    positions: torch.Tensor            # [N]
    slots: torch.Tensor                # [N] cache slot each new token's key/value is written to
    logit_index: torch.Tensor          # [R] flat positions whose logits are returned
    decode: DecodeGroup | None = None
    prefills: list[PrefillRow] = field(default_factory=list)
    rope: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def _slots(seq: KVSequence, start: int, end: int, block_size: int) -> list[int]:
    table = seq.block_table
    return [table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def _mask(q_pos: torch.Tensor, kv_len: int, window: int | None) -> torch.Tensor:
    """[rows, T, kv_len] bool: key j visible to a query at position p if j <= p (and p - j < window)."""
    keys = torch.arange(kv_len, device=q_pos.device)
    q = q_pos.unsqueeze(-1)
    mask = keys <= q
    if window is not None:
        mask &= keys > q - window
    return mask


def build_batch(rows: list[StepRow], block_size: int, window: int | None, device: torch.device) -> ForwardBatch:
    """Lay out `rows` as one flat forward pass; `window` is the sliding-window size (None: no sliding layers)."""
    ids, positions, slots, logit_index = [], [], [], []
    decode_rows: list[tuple[int, StepRow]] = []
    prefill_rows: list[tuple[int, StepRow]] = []
    for row in rows:
        begin = len(ids)
        ids += row.seq.tokens[row.start:row.end]
        positions += range(row.start, row.end)
        slots += _slots(row.seq, row.start, row.end, block_size)
        if row.logits == "all":
            logit_index += range(begin, len(ids))
        elif row.logits == "last":
            logit_index.append(len(ids) - 1)
        (decode_rows if row.end - row.start == 1 else prefill_rows).append((begin, row))

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    batch = ForwardBatch(tensor(ids), tensor(positions), tensor(slots), tensor(logit_index))

    def blocks(row: StepRow) -> list[int]:
        return row.seq.block_table[:-(-row.end // block_size)]

    if decode_rows:
        lengths = [row.end for _, row in decode_rows]
        tables = [blocks(row) for _, row in decode_rows]
        widest = max(len(t) for t in tables)
        # Padding repeats a row's own first block: it is masked out, and never an unwritten (garbage) block.
        key_blocks = tensor([t + [t[0]] * (widest - len(t)) for t in tables])
        q_pos = tensor([n - 1 for n in lengths]).unsqueeze(1)
        span = widest * block_size
        full = _mask(q_pos, span, None).unsqueeze(1) if any(n != span for n in lengths) else None
        sliding = None
        if window is not None and max(lengths) > window:
            sliding = _mask(q_pos, span, window).unsqueeze(1)
        batch.decode = DecodeGroup(tensor([b for b, _ in decode_rows]), key_blocks, full,
                                   sliding if sliding is not None else full, whole_batch=not prefill_rows)
    for begin, row in prefill_rows:
        t = row.end - row.start
        fresh = row.start == 0
        key_blocks = None if fresh else tensor(blocks(row))
        span = row.end if fresh else len(key_blocks) * block_size
        q_pos = tensor(list(range(row.start, row.end))).unsqueeze(0)
        full = None if fresh else _mask(q_pos, span, None).unsqueeze(1)
        sliding = full
        if window is not None and row.end > window:
            sliding = _mask(q_pos, span, window).unsqueeze(1)
        batch.prefills.append(PrefillRow(begin, begin + t, key_blocks, full, sliding))
    return batch
