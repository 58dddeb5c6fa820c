"""`ForwardBatch`: the rows of one forward pass (prefill chunks and decode tokens of many sequences), flattened.

All new tokens of all rows form one [N] sequence for the projections and MLPs, the bulk of the work: the decode
tokens (rows of one new token) first, then the short prefill chunks, then the long ones. The first `packed_tokens`
go through the packed matmul kernels, the rest through the dense copies (quant.packed_rows): which one a row takes
depends only on the row itself. Attention is per row: the decode rows form one batched group reading their keys
through the block tables; each longer chunk (a prefill) attends on its own.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .block_manager import KVSequence
from .quant import DENSE_MIN_ROWS


@dataclass(frozen=True)
class StepRow:
    """Compute tokens [start, end) of `seq`; `logits`: "last" (next-token logits), "all" (every position), "none"."""

    seq: KVSequence
    start: int
    end: int
    logits: str = "last"


@dataclass
class DecodeGroup:
    size: int                          # Bd: the rows' tokens are the first Bd of the flat batch
    key_blocks: torch.Tensor | None    # [Bd, nb] cache blocks holding each row's keys (padded with its first block)
    full_mask: torch.Tensor | None     # [Bd, 1, 1, nb * block] bool; None when every slot of every row is a key
    sliding_mask: torch.Tensor | None
    # One row whose blocks are consecutive: its keys are cache slots [first, first + length), read in place
    # (no gather, no mask); key_blocks and the masks are then None.
    key_span: tuple[int, int] | None = None


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
    logit_index: torch.Tensor          # [R] flat positions whose logits are returned, in the order of the rows
    decode: DecodeGroup | None = None
    prefills: list[PrefillRow] = field(default_factory=list)
    packed_tokens: int = 0             # the decode tokens and the short chunks' tokens, first in the flat batch
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


def _consecutive(table: list[int]) -> bool:
    return table[-1] - table[0] == len(table) - 1 and all(b - a == 1 for a, b in zip(table, table[1:]))


def build_batch(rows: list[StepRow], block_size: int, window: int | None, device: torch.device) -> ForwardBatch:
    """Lay out `rows` as one flat forward pass; `window` is the sliding-window size (None: no sliding layers)."""
    decode_rows = [row for row in rows if row.end - row.start == 1]
    short_rows = [row for row in rows if 1 < row.end - row.start < DENSE_MIN_ROWS]
    prefill_rows = short_rows + [row for row in rows if row.end - row.start >= DENSE_MIN_ROWS]
    ids, positions, slots = [], [], []
    begins: dict[int, int] = {}
    for row in decode_rows + prefill_rows:
        begins[id(row)] = len(ids)
        ids += row.seq.tokens[row.start:row.end]
        positions += range(row.start, row.end)
        slots += _slots(row.seq, row.start, row.end, block_size)
    logit_index: list[int] = []
    for row in rows:
        begin = begins[id(row)]
        if row.logits == "all":
            logit_index += range(begin, begin + row.end - row.start)
        elif row.logits == "last":
            logit_index.append(begin + row.end - row.start - 1)

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    batch = ForwardBatch(tensor(ids), tensor(positions), tensor(slots), tensor(logit_index),
                         packed_tokens=len(decode_rows) + sum(row.end - row.start for row in short_rows))

    def blocks(row: StepRow) -> list[int]:
        return row.seq.block_table[:-(-row.end // block_size)]

    if len(decode_rows) == 1 and _consecutive(blocks(decode_rows[0])):
        row = decode_rows[0]
        batch.decode = DecodeGroup(1, None, None, None, key_span=(row.seq.block_table[0] * block_size, row.end))
    elif decode_rows:
        lengths = [row.end for row in decode_rows]
        tables = [blocks(row) for row in decode_rows]
        widest = max(len(t) for t in tables)
        # Padding repeats a row's own first block: it is masked out, and never an unwritten (garbage) block.
        key_blocks = tensor([t + [t[0]] * (widest - len(t)) for t in tables])
        q_pos = tensor([n - 1 for n in lengths]).unsqueeze(1)
        span = widest * block_size
        full = _mask(q_pos, span, None).unsqueeze(1) if any(n != span for n in lengths) else None
        sliding = None
        if window is not None and max(lengths) > window:
            sliding = _mask(q_pos, span, window).unsqueeze(1)
        batch.decode = DecodeGroup(len(decode_rows), key_blocks, full, sliding if sliding is not None else full)
    for row in prefill_rows:
        begin = begins[id(row)]
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
