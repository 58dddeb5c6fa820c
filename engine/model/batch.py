"""`ForwardBatch`: the rows of one forward pass (prefill chunks and decode tokens of many sequences), flattened.

All new tokens of all rows form one [N] sequence for the projections and MLPs, the bulk of the work: the decode
tokens (rows of one new token) first, then the short prefill chunks, then the long ones. The first `packed_rows`
tokens go through the packed matmul kernels, the rest through the dense copies (quant.PackedLinear): which one a
row takes depends only on the row itself. Attention is per row: the decode rows form one batched group reading their
keys in place (one row with consecutive blocks, or through block tables with the paged kernel on a GPU) or through
a gather of their blocks; each longer chunk (a prefill) attends on its own, or (on a GPU: over cached blocks, or beside other
prompts) all together through the paged prefill kernel.

A deterministic batch sends every token through the same kernels, whatever the row and its neighbours: packed
kernels (or padded dense matmuls) for every row, and attention in float64 (layers.exact_attention).

`ForwardBatch` is a NamedTuple of tensors, ints and lists so that TorchScript (the CPU decoder stack) and CUDA-graph
capture (static buffers of the same fields) take it as it is.
"""
# No `from __future__ import annotations`: TorchScript reads the NamedTuple's annotations as types.
from typing import List, NamedTuple, Optional

import torch
from torch import Tensor

from engine.cache.block_manager import KVSequence

# Rows from which a dense bfloat16 matmul beats the packed kernels on CPU (bench/matmul_formats.py): shorter chunks
# are laid out right after the decode rows and take the packed kernels with them.
DENSE_MIN_ROWS = 32
# A chunk over cached blocks takes the compiled CPU attention kernel (keys read in place) while its queries times
# keys are at most this: one query at a time, past it a gather and torch's fused attention win (a 12-token question
# after a 2,048-token cached prefix: bench/RESULTS.md#issue-17-cpu-fused-kernels). Where the build has the chunk kernel
# (AVX-512, `chunk_kernel`), every chunk over cached blocks takes it: it wins at every size. Decode rows always
# take the kernel.
CPU_PAGED_MAX_CHUNK_WORK = 8192


class StepRow(NamedTuple):
    """Compute tokens [start, end) of `seq`; `logits`: "last" (next-token logits), "all" (every position), "none".

    A NamedTuple: a step makes one per sequence, and a frozen dataclass costs several times as much to build."""

    seq: KVSequence
    start: int
    end: int
    logits: str = "last"


class ForwardBatch(NamedTuple):
    ids: Tensor                        # [N] the new tokens of every row, decode rows first
    positions: Tensor                  # [N]
    slots: Tensor                      # [N] cache slot each new token's key/value is written to
    logit_index: Tensor                # [R] flat positions whose logits are returned, in the order of the rows
    block_size: int
    packed_rows: int                   # leading tokens that take the packed kernels (decode rows, short chunks)
    deterministic: bool                # every row through the same kernels (see the module docstring)
    decode_rows: int                   # Bd: rows of one new token, the first Bd of the flat batch
    span_first: int                    # one decode row with consecutive blocks: its keys are cache slots
    span_length: int                   # [span_first, span_first + span_length), read in place (0: not used)
    key_blocks: Optional[Tensor]       # [Bd, nb] blocks of each decode row's keys (gather; padded: first block)
    full_mask: Optional[Tensor]        # [Bd, 1, 1, nb * block] bool; None when every gathered slot is a key
    sliding_mask: Optional[Tensor]     # the same within the sliding window (full_mask when no row exceeds it)
    block_tables: Optional[Tensor]     # [Bd, W] int32: decode rows' blocks for the paged kernel (GPU; CPU compiled)
    seq_lens: Optional[Tensor]         # [Bd] int32: decode rows' key counts for the paged kernel (0: padding)
    prefill_begins: List[int]          # each prefill row attended on its own: its tokens are [begin, end)
    prefill_ends: List[int]
    prefill_key_blocks: List[Optional[Tensor]]     # blocks of the row's keys; None: a fresh sequence (own k, v)
    prefill_full_masks: List[Optional[Tensor]]     # [1, 1, T, nb * block] bool; None: plain causal
    prefill_sliding_masks: List[Optional[Tensor]]
    paged_prefill: Optional[Tensor]    # [3, Rc] int32 query starts, query lens, key counts of the cached prefill
    prefill_tables: Optional[Tensor]   # [Rc, W] int32 rows, which then take the paged prefill kernel (GPU)
    prefill_max_query: int


class TokenFeed(NamedTuple):
    """Tokens a step reads on the device rather than from its rows' sequences (async scheduling: the previous
    step's samples, not on the host yet): row i's first token is tokens[sources[i]] where sources[i] >= 0, and its
    place in the sequence holds PENDING_TOKEN. Only a row's first token can be fed."""

    tokens: Tensor         # [K] int64 on the step's device
    sources: List[int]     # per row: an index into tokens, or -1 (the row's tokens are its sequence's)

    def is_identity(self, rows: int) -> bool:
        """Whether the first `rows` rows are fed, in order, from tokens[0:rows] (and no other row is)."""
        return len(self.sources) == rows and all(s == i for i, s in enumerate(self.sources))


def feed_ids(ids: Tensor, places: List[int], feed: TokenFeed, rows: List[int]) -> None:
    """ids[places[j]] = feed.tokens[feed.sources[rows[j]]] for the fed rows among `rows`, on the device and
    without waiting for it (the indices go over pinned memory)."""
    pairs = [(p, feed.sources[r]) for p, r in zip(places, rows) if feed.sources[r] >= 0]
    if not pairs:
        return
    index = torch.tensor(pairs, dtype=torch.long).t().contiguous()
    if ids.device.type == "cuda":
        index = index.pin_memory().to(ids.device, non_blocking=True)
    ids.index_copy_(0, index[0], feed.tokens.index_select(0, index[1]).to(ids.dtype))


def _slots(seq: KVSequence, start: int, end: int, block_size: int) -> list[int]:
    table = seq.block_table
    return [table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def _mask(q_pos: Tensor, kv_len: int, window: int | None) -> Tensor:
    """[rows, T, kv_len] bool: key j visible to a query at position p if j <= p (and p - j < window)."""
    keys = torch.arange(kv_len, device=q_pos.device)
    q = q_pos.unsqueeze(-1)
    mask = keys <= q
    if window is not None:
        mask &= keys > q - window
    return mask


def _consecutive(table: list[int]) -> bool:
    return table[-1] - table[0] == len(table) - 1 and all(b - a == 1 for a, b in zip(table, table[1:]))


def _tables(tables: list[list[int]], device: torch.device, width: int | None = None) -> Tensor:
    """[R, width or the widest] int32, each table padded with its own first block (a valid block, never read past
    its length)."""
    widest = max(width or 0, max(len(t) for t in tables))
    return torch.tensor([t + [t[0]] * (widest - len(t)) for t in tables], dtype=torch.int32, device=device)


def build_batch(rows: list[StepRow], block_size: int, window: int | None, device: torch.device, *,
                paged: bool = False, paged_decode: bool = False, chunk_kernel: bool = False,
                table_width: int | None = None, deterministic: bool = False,
                feed: TokenFeed | None = None) -> ForwardBatch:
    """Lay out `rows` as one flat forward pass; `window` is the sliding-window size (None: no sliding layers);
    `paged`: attention over cached blocks through the paged kernels (block tables) rather than gathers, the tables
    `table_width` wide (the width CUDA-graph steps use: then every step launches the kernels compiled for those);
    `paged_decode`: the decode rows, and the chunks over cached blocks whose queries times keys are few
    (CPU_PAGED_MAX_CHUNK_WORK; any with `chunk_kernel`), through block tables; longer chunks through gathers (CPU:
    the compiled kernels); `feed`: the rows' first tokens that are read on the device (TokenFeed)."""
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

    def tensor(values: list[int]) -> Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    def blocks(row: StepRow) -> list[int]:
        return row.seq.block_table[:-(-row.end // block_size)]

    packed = len(ids) if deterministic else len(decode_rows) + sum(row.end - row.start for row in short_rows)
    span_first = span_length = 0
    key_blocks = full_mask = sliding_mask = block_tables = seq_lens = None
    if (paged or paged_decode) and decode_rows:
        block_tables = _tables([blocks(row) for row in decode_rows], device, table_width)
        seq_lens = torch.tensor([row.end for row in decode_rows], dtype=torch.int32, device=device)
    elif len(decode_rows) == 1 and _consecutive(blocks(decode_rows[0])):
        span_first, span_length = decode_rows[0].seq.block_table[0] * block_size, decode_rows[0].end
    elif decode_rows:
        lengths = [row.end for row in decode_rows]
        tables = [blocks(row) for row in decode_rows]
        widest = max(len(t) for t in tables)
        key_blocks = _tables(tables, device).long()  # padding repeats a row's own first block: masked out
        q_pos = tensor([n - 1 for n in lengths]).unsqueeze(1)
        span = widest * block_size
        full_mask = _mask(q_pos, span, None).unsqueeze(1) if any(n != span for n in lengths) else None
        sliding_mask = full_mask
        if window is not None and max(lengths) > window:
            sliding_mask = _mask(q_pos, span, window).unsqueeze(1)
    p_begins, p_ends, p_blocks, p_full, p_sliding = [], [], [], [], []
    cached = []
    # On a GPU several fresh prompts join the chunks over cached blocks in the one paged prefill call: attended one
    # by one, each costs a fused-attention launch per layer from the host (a burst of 64 prompts: 1,024 of them).
    fresh_paged = paged and len(prefill_rows) > 1
    for row in prefill_rows:
        begin = begins[id(row)]
        n = row.end - row.start
        small = chunk_kernel or n * row.end <= CPU_PAGED_MAX_CHUNK_WORK
        if (row.start > 0 or fresh_paged) and (paged or (paged_decode and small)):  # one paged prefill call
            cached.append((begin, row))
            continue
        p_begins.append(begin)
        p_ends.append(begin + row.end - row.start)
        if row.start == 0:  # a fresh sequence: its keys are exactly the chunk's own
            p_blocks.append(None)
            p_full.append(None)
            p_sliding.append(_mask(tensor(list(range(row.end))).unsqueeze(0), row.end, window).unsqueeze(1)
                             if window is not None and row.end > window else None)
            continue
        row_blocks = tensor(blocks(row))
        q_pos = tensor(list(range(row.start, row.end))).unsqueeze(0)
        full = _mask(q_pos, len(row_blocks) * block_size, None).unsqueeze(1)
        p_blocks.append(row_blocks)
        p_full.append(full)
        p_sliding.append(_mask(q_pos, len(row_blocks) * block_size, window).unsqueeze(1)
                         if window is not None and row.end > window else full)
    paged_prefill = prefill_tables = None
    if cached:
        paged_prefill = torch.tensor([[b for b, _ in cached], [r.end - r.start for _, r in cached],
                                      [r.end for _, r in cached]], dtype=torch.int32, device=device)
        prefill_tables = _tables([blocks(r) for _, r in cached], device, table_width)
    ids_tensor = tensor(ids)
    if feed is not None:
        index = {id(row): i for i, row in enumerate(rows)}
        flat = decode_rows + prefill_rows
        feed_ids(ids_tensor, [begins[id(r)] for r in flat], feed, [index[id(r)] for r in flat])
    return ForwardBatch(
        ids_tensor, tensor(positions), tensor(slots), tensor(logit_index), block_size, packed, deterministic,
        len(decode_rows), span_first, span_length, key_blocks, full_mask, sliding_mask, block_tables, seq_lens,
        p_begins, p_ends, p_blocks, p_full, p_sliding, paged_prefill, prefill_tables,
        max((r.end - r.start for _, r in cached), default=0))
