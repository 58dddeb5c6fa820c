"""Attention that reads keys and values in place from the paged KV pool through block tables (GPU, Triton).

The pool (`PagedKVCache`) holds one layer's keys and values as [kv_heads, num_blocks * block_size, head_dim],
token position p of a row at slot `table[p // block_size] * block_size + p % block_size`. Both kernels read those
slots directly, tile by tile, in the cache's dtype: no gather into a new tensor, no float32 copy of the cache.
Scores, the online softmax and the output accumulate in float32; the output takes q's dtype.

Launch layout, and why:

* `paged_decode_attention` (one new token per row) runs programs (row, KV head, segment). A program takes the
  GROUP = H / KVH query heads of its KV head together, as the rows of one [16+, head_dim] matrix (padded to the
  tensor cores' smallest M), so each key and value is read once per KV head rather than once per query head.
  Decode is memory-bound and a (row, KV head) grid is tiny at small batch (batch 1 of an 8-KV-head model is 8
  programs on a 132-SM H200), so each row's visible keys are also split into up to `segments` parts
  (flash-decoding): a segment's partial accumulator and (max, sum) go to a float32 scratch buffer and a second
  kernel, programs (row, query head), merges them. The segment count comes from static shapes only (batch, KV
  heads, the block table's width, the SM count), never from the sequence lengths, so the grid is fixed for a
  given batch bucket and the launch can be captured in a CUDA graph; each program finds its own key range from
  `seq_lens` on the device, and segments past a row's keys (and all of a padding row's, seq_len 0) write nothing.
  Once batch x KV heads fills the GPU, one segment is used and the kernel writes the output itself (no scratch,
  no second launch). With a sliding window only the window's keys are split, so the work follows the window.
* `paged_prefill_attention` (chunks of several rows packed as [T, H, D]) runs programs (row, query tile, KV
  head): BLOCK_Q query tokens times the GROUP heads of one KV head form the BLOCK_M rows of one matrix (the keys
  again read once per KV head), against the row's keys from the first the tile can see (0, or the window's start)
  to its last query position, causal. The grid is (rows, cdiv(max_query_len, BLOCK_Q), KV heads): pass
  `max_query_len` when it is known on the host; the default bound T is always safe, and tiles past a row's own
  queries exit at once.

Keys and values are loaded BLOCK_N tokens at a time (at most 16 KB a tile: 64 tokens for 16-bit heads up to 128,
32 at 256), a tile crossing cache blocks freely (each token's block comes from the table), so three software
pipeline stages of both fit in shared memory. The segment count aims at two programs per SM (at most 32 parts,
never more than the table has tiles), its scratch [B, H, segments, head_dim] float32.

Attention sinks (gpt-oss: a logit per query head that joins its every softmax, with no value) start each query's
online softmax at (max = the sink, sum = 1); split decode rows add them once, in the reduction. Without sinks the
kernels are compiled as they would be without the feature (HAS_SINKS is a constexpr).

Both take tensors on the device and read lengths there: no host synchronisation. Scratch buffers are allocated
per call (inside a CUDA-graph capture they come from the graph's pool). Without Triton (or for CPU tensors outside
TRITON_INTERPRET=1) the same calls run `engine.kernels.paged_attention_torch`'s batched torch fallback.
"""
from __future__ import annotations

import functools
import math
import os

import torch

from engine.kernels import paged_attention_torch

try:
    from engine.kernels import paged_attention_triton as _kernels
except ModuleNotFoundError as e:  # no triton in this environment: the torch fallback serves every call
    if e.name != "triton":
        raise
    _kernels = None

BACKENDS = ("auto", "triton", "torch")
MAX_SEGMENTS = 32
_LOG2E = 1.4426950408889634


def triton_available() -> bool:
    """Whether the Triton kernels were imported."""
    return _kernels is not None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _use_triton(backend: str, device: torch.device) -> bool:
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; use one of {', '.join(BACKENDS)}")
    runnable = _kernels is not None and (device.type == "cuda" or _interpreting())
    if backend == "triton" and not runnable:
        raise RuntimeError("the Triton paged-attention kernels cannot run here: "
                           + ("triton is not installed" if _kernels is None else
                              f"{device.type} tensors need a CUDA device or TRITON_INTERPRET=1"))
    return runnable and backend != "torch"


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: few "SMs", so that small test batches still split into segments


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _check_cache(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, block_tables: torch.Tensor,
                 block_size: int) -> None:
    if keys.dim() != 3 or keys.shape != values.shape:
        raise ValueError(f"keys and values must be [kv_heads, slots, head_dim] alike, got {tuple(keys.shape)} "
                         f"and {tuple(values.shape)}")
    if q.shape[-1] != keys.shape[-1] or q.shape[-2] % keys.shape[0]:
        raise ValueError(f"q {tuple(q.shape)} does not fit the cache's {keys.shape[0]} KV heads of dim "
                         f"{keys.shape[-1]}: heads must be a multiple of the KV heads")
    if not q.dtype == keys.dtype == values.dtype:
        raise ValueError(f"q, keys and values must share a dtype, got {q.dtype}, {keys.dtype}, {values.dtype}")
    if keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError("keys and values must be contiguous along head_dim")
    if block_size < 1 or keys.shape[1] % block_size:
        raise ValueError(f"the pool's {keys.shape[1]} slots are not whole blocks of {block_size}")
    if block_tables.dim() != 2 or block_tables.dtype not in (torch.int32, torch.int64):
        raise ValueError("block_tables must be an int32 (or int64) [rows, width] tensor")


def _dot_options(dtype: torch.dtype) -> dict[str, object]:
    """float32 caches get exact float32 products; 16-bit ones run on the tensor cores (float32 accumulation).
    Triton's interpreter multiplies bfloat16 as raw bits, so there the products are taken in float32."""
    return {"PRECISION": "ieee" if dtype == torch.float32 else "tf32",
            "DOT_F32": _interpreting() and dtype == torch.bfloat16}


def decode_segments(batch: int, kv_heads: int, max_keys: int, block_n: int, sms: int) -> int:
    """How many parts each row's keys are split into: enough programs for about two per SM, at most one tile each
    part of the widest table, MAX_SEGMENTS at most; 1 once the rows alone fill the `sms` multiprocessors."""
    programs = max(1, batch * kv_heads)
    if programs >= sms:
        return 1
    wanted = _next_pow2(-(-2 * sms // programs))
    return max(1, min(wanted, MAX_SEGMENTS, -(-max_keys // block_n)))


def _keys_per_tile(head_dim: int, element_size: int) -> int:
    """Keys per loaded tile: 16 KB of keys (and as much of values) at most, so that three pipeline stages of both
    fit in shared memory with room to spare; 64 for 16-bit heads up to 128, 32 at 256, 16 for float32 at 256."""
    fitting = 16384 // (head_dim * element_size)
    return max(16, min(64, 1 << (fitting.bit_length() - 1)))  # the largest power of two that fits


DECODE_WARPS = 4


def decode_config(heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype, segments: int,
                  windowed: bool, sinks: bool = False) -> tuple[dict[str, object], dict[str, object]]:
    """The constexprs of the decode kernel and of its reduction for these shapes (sm_90, bf16, 4 warps: 72, 120
    and 125 registers a thread at head_dim 64, 128 and 256, no spills, the key loop software-pipelined)."""
    group = heads // kv_heads
    common = dict(HEAD_DIM=head_dim, D_PAD=_next_pow2(head_dim),
                  BLOCK_N=_keys_per_tile(head_dim, torch.empty((), dtype=dtype).element_size()),
                  NUM_SEGMENTS=segments, WINDOWED=windowed, HAS_SINKS=sinks)
    return (dict(common, GROUP=group, G_PAD=max(16, _next_pow2(group)), BLOCK_SIZE=block_size, **_dot_options(dtype)),
            dict(common, SEG_PAD=max(2, _next_pow2(segments))))


def _check_sinks(sinks: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
    """The sinks as the kernels read them: float32 [H], contiguous, on q's device."""
    if sinks is None:
        return None
    if sinks.shape != (q.shape[-2],):
        raise ValueError(f"sinks must be [{q.shape[-2]}], one per query head, got {tuple(sinks.shape)}")
    return sinks.to(device=q.device, dtype=torch.float32).contiguous()


def paged_decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, block_size: int, scale: float, window: int = 0,
                           out: torch.Tensor | None = None, *, segments: int | None = None,
                           backend: str = "auto", sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one new query per row, q [B, H, D], over each row's cached keys 0..seq_len-1 → [B, H, D].

    `block_tables` [B, W] int32 lists each row's blocks in order (entries past its length: any valid block id);
    `seq_lens` [B] int32 (0: a padding row, output zeros); `window` > 0 keeps only the last `window` keys;
    `out` a [B, H, D] buffer of q's dtype to write into; `segments` overrides the split of the key range
    (see the module docstring); `backend` "auto", "triton" or "torch" (the fallback); `sinks` [H]: the heads'
    attention sinks (float32 logits; None: none).
    """
    _check_cache(q, keys, values, block_tables, block_size)
    sinks = _check_sinks(sinks, q)
    b, h, d = q.shape
    kvh = keys.shape[0]
    out = torch.empty_like(q) if out is None else out
    if b == 0:
        return out
    if not _use_triton(backend, q.device):
        out.copy_(paged_attention_torch.decode(q, keys, values, block_tables, seq_lens, block_size, scale, window,
                                               sinks))
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    if segments is None:
        segments = decode_segments(b, kvh, block_tables.shape[1] * block_size,
                                   _keys_per_tile(d, keys.element_size()), _sm_count(q.device))
    kernel, reduce = decode_config(h, kvh, d, block_size, keys.dtype, segments, window > 0, sinks is not None)
    sinks_arg = q if sinks is None else sinks  # any pointer when there are none: never read
    direct = out.stride(-1) == 1
    target = out if direct else torch.empty_like(q)
    if segments > 1:
        part_acc = torch.empty((b, h, segments, kernel["D_PAD"]), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((b, h, segments, 2), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = target  # unused
    _kernels.paged_decode_kernel[(b, kvh, segments)](
        q, keys, values, block_tables, seq_lens, target, part_acc, part_ml, sinks_arg,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), values.stride(0), values.stride(1),
        block_tables.stride(0), target.stride(0), target.stride(1), window, scale * _LOG2E,
        num_warps=DECODE_WARPS, **kernel)
    if segments > 1:
        _kernels.paged_decode_reduce_kernel[(b, h)](
            seq_lens, part_acc, part_ml, sinks_arg, target, target.stride(0), target.stride(1), window,
            num_warps=DECODE_WARPS, **reduce)
    if not direct:
        out.copy_(target)
    return out


def prefill_config(heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                   windowed: bool, sinks: bool = False) -> tuple[dict[str, object], int]:
    """The prefill kernel's constexprs and warps: BLOCK_M = BLOCK_Q tokens x GROUP heads (64 rows at least), 8 warps
    from head_dim 128 (sm_90, bf16: 186 registers a thread at 4 warps, 132 at 8; at 256, 171 with 8, spills with 4)."""
    group = heads // kv_heads
    block_m = max(64, _next_pow2(group))
    warps = 4 if head_dim <= 64 else 8
    return (dict(HEAD_DIM=head_dim, D_PAD=_next_pow2(head_dim), GROUP=group, BLOCK_M=block_m,
                 BLOCK_Q=block_m // group, BLOCK_SIZE=block_size,
                 BLOCK_N=_keys_per_tile(head_dim, torch.empty((), dtype=dtype).element_size()), WINDOWED=windowed,
                 HAS_SINKS=sinks, **_dot_options(dtype)), warps)


def paged_prefill_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, block_tables: torch.Tensor,
                            seq_lens: torch.Tensor, query_lens: torch.Tensor, query_starts: torch.Tensor,
                            block_size: int, scale: float, window: int = 0, out: torch.Tensor | None = None, *,
                            max_query_len: int | None = None, backend: str = "auto",
                            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of packed query chunks, q [T, H, D], over the cached keys of their rows → [T, H, D].

    Row r's queries are q[query_starts[r] : query_starts[r] + query_lens[r]] at positions seq_lens[r] -
    query_lens[r] .. seq_lens[r] - 1; its keys (the chunk's own included, already written) are positions
    0..seq_lens[r] - 1 through `block_tables[r]`. A query at position p sees keys 0..p (with `window` > 0 only
    those > p - window). Tokens of q that no row claims are left as they are in `out`. `max_query_len` (a host
    int) bounds the grid; by default T. `sinks` [H]: the heads' attention sinks (None: none).
    """
    _check_cache(q, keys, values, block_tables, block_size)
    sinks = _check_sinks(sinks, q)
    t, h, d = q.shape
    kvh = keys.shape[0]
    out = torch.empty_like(q) if out is None else out
    rows = block_tables.shape[0]
    if t == 0 or rows == 0:
        return out
    if not _use_triton(backend, q.device):
        paged_attention_torch.prefill(q, keys, values, block_tables, seq_lens, query_lens, query_starts,
                                      block_size, scale, window, out, sinks)
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    kernel, warps = prefill_config(h, kvh, d, block_size, keys.dtype, window > 0, sinks is not None)
    direct = out.stride(-1) == 1
    target = out if direct else out.contiguous()
    tiles = math.ceil(min(max_query_len or t, t) / kernel["BLOCK_Q"])
    _kernels.paged_prefill_kernel[(rows, tiles, kvh)](
        q, keys, values, block_tables, seq_lens, query_lens, query_starts, target, q if sinks is None else sinks,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), values.stride(0), values.stride(1),
        block_tables.stride(0), target.stride(0), target.stride(1), window, scale * _LOG2E,
        num_warps=warps, **kernel)
    if not direct:
        out.copy_(target)
    return out
