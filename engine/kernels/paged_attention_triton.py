"""The Triton kernels of `engine.kernels.paged_attention` (launch layout and why: see that module); imports triton.

Every kernel reads keys and values where they lie in the paged pool: token position p of a row is cache slot
`table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE` of its KV head, loaded tile by tile in the cache's own dtype,
with scores, softmax and the output accumulated in float32 (online softmax, base 2: the scale carries log2(e)).
Cache offsets are int64: a layer's pool passes 2**31 elements on a large GPU. With HAS_SINKS, a query head's
attention sink (a float32 logit, natural units) starts its online softmax: max = the sink in log2 units, sum = 1.
"""
from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _attend_tiles(acc, m_i, l_i, q, q_pos, row_ok, kv_lo, kv_hi, table_row, k_base, v_base, stride_ks, stride_vs,
                  d_offs, d_ok, window, qk_scale,
                  BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, WINDOWED: tl.constexpr,
                  PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
    """Fold the keys at positions [kv_lo, kv_hi) of one row and KV head into the running (acc, m_i, l_i) of the
    query rows `q` [M, D] at positions `q_pos` [M]: causal, and within `window` keys when WINDOWED.

    DOT_F32 multiplies in float32 whatever the cache's dtype: only for Triton's CPU interpreter, whose dot
    multiplies bfloat16 operands as their raw 16-bit patterns."""
    for start in range(kv_lo, kv_hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        in_range = pos < kv_hi
        block = tl.load(table_row + pos // BLOCK_SIZE, mask=in_range, other=0).to(tl.int64)
        slot = block * BLOCK_SIZE + pos % BLOCK_SIZE
        tile_ok = in_range[:, None] & d_ok[None, :]
        k = tl.load(k_base + slot[:, None] * stride_ks + d_offs[None, :], mask=tile_ok, other=0.0)
        if DOT_F32:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        s = s * qk_scale  # [M, N], log2 units
        visible = in_range[None, :] & (pos[None, :] <= q_pos[:, None]) & row_ok[:, None]
        if WINDOWED:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no visible key yet keeps m = -inf: shift by 0 so that exp2 gives 0, never NaN.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - shift[:, None])
        alpha = tl.exp2(m_i - shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + slot[:, None] * stride_vs + d_offs[None, :], mask=tile_ok, other=0.0)
        if DOT_F32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _decode_segment(seq_len, segment, window, NUM_SEGMENTS: tl.constexpr, BLOCK_N: tl.constexpr,
                    WINDOWED: tl.constexpr):
    """Key positions [lo, hi) that `segment` of a decode row covers, and how many segments are non-empty.

    The row's visible keys (the last `window` of them when WINDOWED) are cut into whole BLOCK_N tiles, shared out
    as evenly as NUM_SEGMENTS allows; segments past the last tile are empty (lo >= hi)."""
    first = 0
    if WINDOWED:
        first = tl.maximum(seq_len - window, 0)
    tile_lo = first // BLOCK_N
    n_tiles = tl.cdiv(seq_len, BLOCK_N) - tile_lo
    per_segment = tl.cdiv(n_tiles, NUM_SEGMENTS)
    lo = tl.maximum((tile_lo + segment * per_segment) * BLOCK_N, first)
    hi = tl.minimum((tile_lo + (segment + 1) * per_segment) * BLOCK_N, seq_len)
    used = tl.where(per_segment > 0, tl.cdiv(n_tiles, tl.maximum(per_segment, 1)), 0)
    return lo, hi, used


# Triton specialises on the int arguments' divisibility by 16 (aligned, vectorised loads: a much faster decode
# than without, bench/RESULTS.md#issue-32-paged-decode-specialisation). The engine passes block tables of one
# fixed width (engine/model/batch.py), so the variants it needs are compiled at start-up (Runner.capture_cuda_graphs) and
# none while serving.
@triton.jit
def paged_decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, seq_lens_ptr, out_ptr, part_acc_ptr, part_ml_ptr, sinks_ptr,
                        stride_qb, stride_qh, stride_kh, stride_ks, stride_vh, stride_vs, stride_tb,
                        stride_ob, stride_oh, window, qk_scale,
                        HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr,
                        BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
                        WINDOWED: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
                        HAS_SINKS: tl.constexpr):
    """Program (row, KV head, segment): the GROUP query heads of one KV head against one segment of the row's keys.

    One segment: the normalised output straight into `out`. Several: the segment's unnormalised accumulator and
    its (max, sum) into the partial buffers, for `paged_decode_reduce_kernel` (which adds the sinks then)."""
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + row)
    lo, hi, _ = _decode_segment(seq_len, segment, window, NUM_SEGMENTS, BLOCK_N, WINDOWED)

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + row * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = tl.zeros([G_PAD], dtype=tl.int32) + (seq_len - 1)
    acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
    m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    if HAS_SINKS and NUM_SEGMENTS == 1:  # the sink is the first "key": max = its logit, sum = exp(0)
        m_i = tl.load(sinks_ptr + heads, mask=g_ok, other=0.0) * LOG2E
        l_i = tl.full([G_PAD], 1.0, dtype=tl.float32)
    kv_off = kv_head.to(tl.int64)
    acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, q_pos, g_ok, lo, hi, tables_ptr + row * stride_tb,
                                  k_ptr + kv_off * stride_kh, v_ptr + kv_off * stride_vh, stride_ks, stride_vs,
                                  d, d_ok, window, qk_scale, BLOCK_SIZE, BLOCK_N, WINDOWED, PRECISION, DOT_F32)
    if NUM_SEGMENTS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a padding row (seq_len 0) stays zeros
        tl.store(out_ptr + row * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
    else:
        # partials are [B, H, NUM_SEGMENTS, D_PAD] and [B, H, NUM_SEGMENTS, 2], contiguous
        slot = (row * (tl.num_programs(1) * GROUP) + heads) * NUM_SEGMENTS + segment
        written = g_ok & (lo < hi)
        tl.store(part_acc_ptr + slot[:, None] * D_PAD + d[None, :], acc, mask=written[:, None])
        tl.store(part_ml_ptr + slot * 2, m_i, mask=written)
        tl.store(part_ml_ptr + slot * 2 + 1, l_i, mask=written)


@triton.jit
def paged_decode_reduce_kernel(seq_lens_ptr, part_acc_ptr, part_ml_ptr, sinks_ptr, out_ptr, stride_ob, stride_oh,
                               window, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
                               SEG_PAD: tl.constexpr, BLOCK_N: tl.constexpr, WINDOWED: tl.constexpr,
                               HAS_SINKS: tl.constexpr):
    """Program (row, query head): merge the non-empty segments' partials (and the head's sink) into the output
    (zeros for none)."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + row)
    _, _, used = _decode_segment(seq_len, 0, window, NUM_SEGMENTS, BLOCK_N, WINDOWED)
    s = tl.arange(0, SEG_PAD)
    d = tl.arange(0, D_PAD)
    s_ok = s < used
    slot = (row * tl.num_programs(1) + head) * NUM_SEGMENTS + s
    m = tl.load(part_ml_ptr + slot * 2, mask=s_ok, other=float("-inf"))
    l = tl.load(part_ml_ptr + slot * 2 + 1, mask=s_ok, other=0.0)
    top = tl.max(m, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head) * LOG2E
        top = tl.maximum(top, sink)
    weight = tl.where(s_ok, tl.exp2(m - tl.where(top == float("-inf"), 0.0, top)), 0.0)
    acc = tl.load(part_acc_ptr + slot[:, None] * D_PAD + d[None, :], mask=s_ok[:, None], other=0.0)
    total = tl.sum(weight * l, 0)
    if HAS_SINKS:
        total += tl.exp2(sink - top)
    out = tl.sum(acc * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@triton.jit
def paged_prefill_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, seq_lens_ptr, query_lens_ptr, query_starts_ptr, out_ptr,
                         sinks_ptr, stride_qt, stride_qh, stride_kh, stride_ks, stride_vh, stride_vs, stride_tb,
                         stride_ot, stride_oh, window, qk_scale,
                         HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_Q: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                         WINDOWED: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
                         HAS_SINKS: tl.constexpr):
    """Program (row, query tile, KV head): BLOCK_Q query tokens of a row times the GROUP heads of one KV head, as
    BLOCK_M = BLOCK_Q * GROUP (padded) rows of one matrix, against the row's keys up to the tile's last position."""
    row = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_len = tl.load(query_lens_ptr + row)
    t0 = q_tile * BLOCK_Q
    if t0 < q_len:  # tiles past the row's queries (the grid is sized for the longest) do nothing
        q_start = tl.load(query_starts_ptr + row).to(tl.int64)
        seq_len = tl.load(seq_lens_ptr + row)
        first_pos = seq_len - q_len
        m = tl.arange(0, BLOCK_M)
        d = tl.arange(0, D_PAD)
        token = t0 + m // GROUP
        heads = kv_head * GROUP + m % GROUP
        row_ok = (m < BLOCK_Q * GROUP) & (token < q_len)
        d_ok = d < HEAD_DIM
        q_pos = first_pos + token
        tokens = q_start + token
        q = tl.load(q_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        kv_hi = tl.minimum(first_pos + t0 + BLOCK_Q, seq_len)  # one past the tile's last query position
        kv_lo = 0
        if WINDOWED:
            kv_lo = tl.maximum(first_pos + t0 - window + 1, 0)
        acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        if HAS_SINKS:  # the sink is the first "key": max = its logit, sum = exp(0)
            m_i = tl.load(sinks_ptr + heads) * LOG2E
            l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
        kv_off = kv_head.to(tl.int64)
        acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, q_pos, row_ok, kv_lo, kv_hi, tables_ptr + row * stride_tb,
                                      k_ptr + kv_off * stride_kh, v_ptr + kv_off * stride_vh, stride_ks, stride_vs,
                                      d, d_ok, window, qk_scale, BLOCK_SIZE, BLOCK_N, WINDOWED, PRECISION, DOT_F32)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
