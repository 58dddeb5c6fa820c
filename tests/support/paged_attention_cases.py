"""Random paged-attention problems for tests/engine/kernels/test_paged_attention.py and
tests/gpu/test_paged_attention_cuda.py.

A problem is a pool of key/value blocks, block tables drawn at random from it (scattered, shuffled, rows sharing
prefix blocks, entries past a row's length pointing at other rows' blocks) and the queries of
`paged_decode_attention` or `paged_prefill_attention`. Only the slots of positions 0..seq_len-1 of some row hold
keys; every other slot holds POISON, large enough that one stray read ruins the output. Problems with `sinks` carry
attention sinks (gpt-oss): a float32 logit per query head, drawn around the scores' own range so that the sink takes
a real share of each softmax.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

POISON = 1000.0
OUT_FILL = 7.0
TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}


@dataclass(frozen=True)
class Spec:
    """One problem: `lens` are the rows' seq_lens; `query_lens` (prefill only) how many of them are queries."""

    name: str
    lens: tuple[int, ...]
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    block_size: int = 16
    dtype: torch.dtype = torch.float32
    window: int = 0
    query_lens: tuple[int, ...] | None = None   # None: a decode problem
    extra_width: int = 2                        # table entries past the longest row
    width: int | None = None                    # the tables' width (default: the longest row's plus extra_width)
    shared_blocks: int = 0                      # rows 1.. start with row 0's first blocks
    gap: int = 0                                # prefill: unclaimed tokens between rows' queries
    with_out: bool = False                      # pass an `out` buffer (always with a gap)
    sinks: bool = False                         # attention sinks, one logit per query head
    options: dict[str, Any] = field(default_factory=dict)  # e.g. segments, max_query_len

    @property
    def decode(self) -> bool:
        return self.query_lens is None


def build(spec: Spec, seed: int, device: str | torch.device = "cpu") -> dict[str, Any]:
    """The keyword arguments of the kernel call for `spec`, as tensors on `device`."""
    gen = torch.Generator().manual_seed(seed)
    bs, rows = spec.block_size, len(spec.lens)
    width = spec.width or max(1, -(-max(spec.lens) // bs)) + spec.extra_width
    num_blocks = rows * width + 3
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in range(rows)])
    for r in range(1, rows):
        tables[r, :spec.shared_blocks] = tables[0, :spec.shared_blocks]
    shape = (spec.kv_heads, num_blocks * bs, spec.head_dim)
    keys, values = torch.full(shape, POISON), torch.full(shape, POISON)
    for r, n in enumerate(spec.lens):
        pos = torch.arange(n)
        slots = tables[r, pos // bs] * bs + pos % bs
        keys[:, slots] = torch.randn((spec.kv_heads, n, spec.head_dim), generator=gen)
        values[:, slots] = torch.randn((spec.kv_heads, n, spec.head_dim), generator=gen)
    args: dict[str, Any] = dict(keys=keys.to(spec.dtype), values=values.to(spec.dtype),
                                block_tables=tables.to(torch.int32),
                                seq_lens=torch.tensor(spec.lens, dtype=torch.int32), block_size=bs,
                                scale=spec.head_dim ** -0.5, window=spec.window)
    if spec.decode:
        args["q"] = torch.randn((rows, spec.heads, spec.head_dim), generator=gen).to(spec.dtype)
    else:
        starts, t = [], 0
        for n in spec.query_lens:
            starts.append(t)
            t += n + spec.gap
        args["q"] = torch.randn((t, spec.heads, spec.head_dim), generator=gen).to(spec.dtype)
        args["query_lens"] = torch.tensor(spec.query_lens, dtype=torch.int32)
        args["query_starts"] = torch.tensor(starts, dtype=torch.int32)
    if spec.with_out or spec.gap:  # a caller's buffer; unclaimed prefill tokens must keep what it held
        args["out"] = torch.full_like(args["q"], OUT_FILL)
    if spec.sinks:  # drawn last: the problem's other tensors are those of the same spec without sinks
        args["sinks"] = torch.randn(spec.heads, generator=gen) * 2 + 1
    args.update(spec.options)
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def claimed(spec: Spec, t: int) -> torch.Tensor:
    """[t] bool: the prefill tokens that belong to some row's queries."""
    mask = torch.zeros(t, dtype=torch.bool)
    start = 0
    for n in spec.query_lens:
        mask[start:start + n] = True
        start += n + spec.gap
    return mask


BF16, FP16 = torch.bfloat16, torch.float16
# The problems every paged-attention implementation is checked on (the Triton kernels interpreted and on CUDA, the
# torch fallback, the CPU kernels): decode rows, then chunks of queries over cached blocks.
DECODE = [
    Spec("fp32-gqa4-padding", lens=(37, 0, 64, 5), heads=8, kv_heads=2, options={"segments": 2}),
    Spec("fp32-window-bs8-seg3", lens=(100, 17, 0), block_size=8, window=24, options={"segments": 3}),
    Spec("bf16-d128-shared-seg8", lens=(90, 33), heads=4, kv_heads=1, head_dim=128, dtype=BF16, shared_blocks=2,
         options={"segments": 8}),
    Spec("bf16-d256-window-bs32", lens=(70, 0, 9), heads=4, kv_heads=1, head_dim=256, block_size=32, dtype=BF16,
         window=16, with_out=True),
    Spec("fp16-mha", lens=(50, 3), heads=4, kv_heads=4, dtype=FP16),
    Spec("fp32-group3", lens=(40, 41), heads=6, kv_heads=2, options={"segments": 2}),
    Spec("fp32-batch1-auto-segments", lens=(150,), heads=8, kv_heads=1, extra_width=4),
    Spec("bf16-bs8-one-segment", lens=(1, 2, 65), block_size=8, dtype=BF16, options={"segments": 1}),
    Spec("fp16-all-padding", lens=(0, 0), dtype=FP16, with_out=True),
    Spec("fp32-sinks-padding-seg2", lens=(37, 0, 64, 5), heads=8, kv_heads=2, sinks=True, options={"segments": 2}),
    Spec("fp32-sinks-window-bs8-seg3", lens=(100, 17, 0), block_size=8, window=24, sinks=True,
         options={"segments": 3}),
    Spec("bf16-sinks-one-segment", lens=(90, 1, 33), heads=8, kv_heads=1, dtype=BF16, sinks=True,
         options={"segments": 1}),
    Spec("bf16-sinks-gpt-oss-window", lens=(200, 9), heads=16, kv_heads=2, window=128, dtype=BF16, sinks=True),
]
PREFILL = [
    Spec("fp32-fresh-chunk-single", lens=(40, 70, 30), query_lens=(40, 20, 1)),
    Spec("fp32-window-bs8", lens=(90, 50), query_lens=(90, 30), block_size=8, window=20),
    Spec("bf16-d128-shared", lens=(60, 35), query_lens=(25, 35), head_dim=128, dtype=BF16, shared_blocks=1),
    Spec("bf16-d256-window-bs32", lens=(80,), query_lens=(80,), heads=4, kv_heads=1, head_dim=256, block_size=32,
         dtype=BF16, window=32),
    Spec("fp16-group3-gaps-empty-row", lens=(30, 20, 10), query_lens=(10, 0, 10), heads=6, kv_heads=2,
         dtype=FP16, gap=3),
    Spec("fp32-max-query-len", lens=(33, 40), query_lens=(5, 8), options={"max_query_len": 8}),
    Spec("fp32-sinks-fresh-chunk-single", lens=(40, 70, 30), query_lens=(40, 20, 1), sinks=True),
    Spec("bf16-sinks-window-bs8-gaps", lens=(90, 50), query_lens=(90, 30), block_size=8, window=20, dtype=BF16,
         gap=2, sinks=True),
    Spec("fp32-sinks-group3-d128-window", lens=(60, 35), query_lens=(25, 35), heads=6, kv_heads=2, head_dim=128,
         window=16, shared_blocks=1, sinks=True),
]
