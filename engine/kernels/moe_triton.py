"""The Triton kernels of `engine.kernels.moe` (the layout and why: see that module); imports triton.

Rows of the grouped GEMMs are *slots*: the (token, k) pairs sorted by expert, each expert's run padded to a multiple
of BLOCK_M, so that every BLOCK_M-row block belongs to one expert and reads that expert's weights once per output
tile. `ends` [E] holds each expert's padded end slot; a block finds its expert by counting the ends at or before its
first slot, and a block at or past the last end returns at once (the grid is sized for the worst routing).
Weights are loaded in their stored format and dequantized in registers before the dot; every product accumulates
in float32.
"""
from __future__ import annotations

import triton
import triton.language as tl

DENSE = tl.constexpr(0)
MXFP4 = tl.constexpr(1)
INT4 = tl.constexpr(2)
SILU = tl.constexpr(0)
SWIGLU_CLAMP = tl.constexpr(1)


# --- alignment: (token, k) pairs → slots grouped by expert --------------------------------------------------------

@triton.jit
def _chunk_hits(ids_ptr, start, num_pairs, E: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """(pair indices [CHUNK], whether each is routed to an expert of this stack, one-hot [CHUNK, E_PAD] int32)."""
    pairs = start + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1).to(tl.int32)
    routed = (ids >= 0) & (ids < E)  # other ids (another rank's experts, padding) take no slot
    hit = (routed[:, None] & (ids[:, None] == tl.arange(0, E_PAD)[None, :])).to(tl.int32)
    return pairs, routed, hit


@triton.jit
def _ranks(hit):
    """Each pair's rank among the chunk's earlier pairs of its expert (keeps the pairs' order within an expert)."""
    return tl.sum((tl.cumsum(hit, axis=0) - hit) * hit, axis=1)


@triton.jit
def moe_count_kernel(ids_ptr, counts_ptr, ranks_ptr, num_pairs,
                     E: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """Program (chunk of CHUNK pairs): its pairs per expert → counts [chunks, E_PAD], each pair's rank within its
    expert in the chunk → ranks [pairs]."""
    c = tl.program_id(0)
    pairs, routed, hit = _chunk_hits(ids_ptr, c * CHUNK, num_pairs, E, E_PAD, CHUNK)
    tl.store(counts_ptr + c * E_PAD + tl.arange(0, E_PAD), tl.sum(hit, axis=0))
    tl.store(ranks_ptr + pairs, _ranks(hit), mask=pairs < num_pairs)


@triton.jit
def moe_align_kernel(ids_ptr, counts_ptr, ranks_ptr, slots_ptr, ends_ptr, num_pairs, num_chunks,
                     E: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr, CHUNK_ROWS: tl.constexpr,
                     BLOCK_M: tl.constexpr, SINGLE: tl.constexpr):
    """Program (chunk): writes its pairs' indices to their slots; program 0 also writes `ends` and the padding
    slots' sentinel (num_pairs). SINGLE: one chunk holds every pair, counted here (no count kernel before)."""
    c = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    pairs, routed, hit = _chunk_hits(ids_ptr, c * CHUNK, num_pairs, E, E_PAD, CHUNK)
    if SINGLE:
        total = tl.sum(hit, axis=0)
        before = tl.zeros((E_PAD,), dtype=tl.int32)
        ranks = _ranks(hit)
    else:
        total = tl.zeros((E_PAD,), dtype=tl.int32)
        before = tl.zeros((E_PAD,), dtype=tl.int32)  # this expert's pairs in the chunks before this one
        c0 = 0
        while c0 < num_chunks:  # (a while: the interpreter's range takes no runtime bound)
            rows = c0 + tl.arange(0, CHUNK_ROWS)
            counts = tl.load(counts_ptr + rows[:, None] * E_PAD + experts[None, :],
                             mask=(rows < num_chunks)[:, None], other=0)
            total += tl.sum(counts, axis=0)
            before += tl.sum(tl.where((rows < c)[:, None], counts, 0), axis=0)
            c0 += CHUNK_ROWS
        ranks = tl.load(ranks_ptr + pairs, mask=pairs < num_pairs, other=0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    slot = tl.sum(hit * (starts + before)[None, :], axis=1) + ranks
    tl.store(slots_ptr + slot, pairs, mask=routed)
    if c == 0:
        tl.store(ends_ptr + experts, ends, mask=experts < E)
        pad = tl.arange(0, BLOCK_M)
        tl.store(slots_ptr + (starts + total)[:, None] + pad[None, :],
                 tl.full((E_PAD, BLOCK_M), 0, tl.int32) + num_pairs,
                 mask=pad[None, :] < (padded - total)[:, None])


# --- the grouped GEMMs ------------------------------------------------------------------------------------------

@triton.jit
def _block_expert(ends_ptr, row0, E: tl.constexpr, E_PAD: tl.constexpr):
    """(expert of the block starting at slot row0, the last padded slot + 1)."""
    experts = tl.arange(0, E_PAD)
    ends = tl.load(ends_ptr + experts, mask=experts < E, other=0x3FFFFFFF)
    total = tl.load(ends_ptr + E - 1)
    return tl.sum((ends <= row0).to(tl.int32), axis=0), total


@triton.jit
def _mxfp4(code, scale_bits, DT: tl.constexpr):
    """MXFP4 elements in DT: E2M1 codes (4 bits: sign, 2 exponent bits, 1 mantissa bit: +-{0, .5, 1, 1.5, 2, 3, 4,
    6}) times 2^(e - 127) of their E8M0 byte e. bfloat16 is built from bits: magnitudes from 1 are the code's 3 bits
    shifted under bfloat16's exponent plus the scale's (`scale_bits` = (e - 1) << 7), 0.5 the scale's exponent
    alone, no float arithmetic (e in 1..253, as trained weights' scales are); other dtypes multiply in float32."""
    c = code.to(tl.int32)
    magnitude = c & 7
    if DT == tl.bfloat16:
        bits = tl.where(magnitude >= 2, (magnitude << 6) + scale_bits, magnitude * scale_bits) | ((c & 8) << 12)
        return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
    exponent = magnitude >> 1
    half = (magnitude & 1) << 22
    value = tl.where(exponent == 0, half * 252, ((exponent + 126) << 23) | half).to(tl.float32, bitcast=True)
    value = tl.where(c >= 8, -value, value)
    return (value * (((scale_bits >> 7) + 1) << 23).to(tl.float32, bitcast=True)).to(DT)


@triton.jit
def _mxfp4_pairs_asm(q, scale):
    """Both nibbles of the MXFP4 bytes q (uint8) as bfloat16 (low, high) times `scale` (bfloat16 powers of two),
    four bytes an instruction sequence: each byte pair spread to 16-bit halves (prmt), each nibble's 3 magnitude
    bits placed under bfloat16's exponent and mantissa and its sign on bit 15 (a subnormal trick: that is the E2M1
    value times 2^-126, exactly, 0.5 included), then two bf16x2 multiplies by 2^126 and by the scale. A handful of
    instructions a weight where the arithmetic of `_mxfp4` takes a dozen or more (the integer units bound the
    4-bit GEMMs otherwise). CUDA only (no inline assembly in the interpreter)."""
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 t, a, b, c, two126, zero;
        mov.b32 two126, 0x7E807E80;
        mov.b32 zero, 0x80008000;
        prmt.b32 t, $4, 0, 0x4140;
        shl.b32 a, t, 6;
        shl.b32 b, t, 12;
        and.b32 a, a, 0x01C001C0;
        and.b32 b, b, 0x80008000;
        or.b32 c, a, b;
        fma.rn.bf16x2 c, c, two126, zero;
        fma.rn.bf16x2 $0, c, $5, zero;
        shl.b32 a, t, 2;
        shl.b32 b, t, 8;
        and.b32 a, a, 0x01C001C0;
        and.b32 b, b, 0x80008000;
        or.b32 c, a, b;
        fma.rn.bf16x2 c, c, two126, zero;
        fma.rn.bf16x2 $2, c, $5, zero;
        prmt.b32 t, $4, 0, 0x4342;
        shl.b32 a, t, 6;
        shl.b32 b, t, 12;
        and.b32 a, a, 0x01C001C0;
        and.b32 b, b, 0x80008000;
        or.b32 c, a, b;
        fma.rn.bf16x2 c, c, two126, zero;
        fma.rn.bf16x2 $1, c, $6, zero;
        shl.b32 a, t, 2;
        shl.b32 b, t, 8;
        and.b32 a, a, 0x01C001C0;
        and.b32 b, b, 0x80008000;
        or.b32 c, a, b;
        fma.rn.bf16x2 c, c, two126, zero;
        fma.rn.bf16x2 $3, c, $6, zero;
        }
        """,
        constraints="=r,=r,=r,=r,r,r,r", args=[q, scale], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)


@triton.jit
def _load_dense(w_rows, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, DT: tl.constexpr):
    """Dense weights [BLOCK_N, BLOCK_K] in DT at inputs k0.. of the output rows starting at `w_rows` [BLOCK_N, 1]."""
    ks = k0 + tl.arange(0, BLOCK_K)[None, :]
    if EVEN_K:
        return tl.load(w_rows + ks).to(DT)
    return tl.load(w_rows + ks, mask=ks < K, other=0.0).to(DT)


@triton.jit
def _load_packed(w_rows, s_rows, o_rows, stride_sg, k0, K: tl.constexpr, BLOCK_K: tl.constexpr,
                 FORMAT: tl.constexpr):
    """4-bit weights as stored, at inputs k0.. (nothing past K) of the output rows starting at `w_rows` [BLOCK_N, 1]:
    (bytes [BLOCK_N, groups, 16], scales and offsets [BLOCK_N, groups, 1] (offsets: the scales again for MXFP4)),
    byte j of a row holding inputs 2j (low nibble) and 2j + 1 (high)."""
    GROUPS: tl.constexpr = BLOCK_K // 32
    group = k0 // 32 + tl.arange(0, GROUPS)[None, :, None]
    ok = group * 32 < K
    q = tl.load(w_rows[:, :, None] + group * 16 + tl.arange(0, 16)[None, None, :], mask=ok, other=0)
    if FORMAT == MXFP4:
        scale = tl.load(s_rows[:, :, None] + group * stride_sg, mask=ok, other=127)
        offset = scale
    else:
        scale = tl.load(s_rows[:, :, None] + group * stride_sg, mask=ok, other=0.0).to(tl.float32)
        offset = tl.load(o_rows[:, :, None] + group * stride_sg, mask=ok, other=0.0).to(tl.float32)
    return q, scale, offset


@triton.jit
def _dequantize(q, scale, offset, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FORMAT: tl.constexpr,
                DT: tl.constexpr, ASM: tl.constexpr):
    """`_load_packed`'s tile as (even inputs, odd inputs) [BLOCK_N, BLOCK_K / 2] in DT."""
    if FORMAT == MXFP4:
        if ASM and DT == tl.bfloat16:
            w0, w1 = _mxfp4_pairs_asm(q, (scale.to(tl.int16) << 7).to(tl.bfloat16, bitcast=True))
        else:
            scale_bits = (tl.maximum(scale.to(tl.int32), 1) - 1) << 7
            w0 = _mxfp4(q & 15, scale_bits, DT)
            w1 = _mxfp4(q >> 4, scale_bits, DT)
    else:  # INT4: code * scale + offset
        w0 = ((q & 15).to(tl.float32) * scale + offset).to(DT)
        w1 = ((q >> 4).to(tl.float32) * scale + offset).to(DT)
    return tl.reshape(w0, (BLOCK_N, BLOCK_K // 2)), tl.reshape(w1, (BLOCK_N, BLOCK_K // 2))


@triton.jit
def _load_xt(x_cols, x_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, PACKED: tl.constexpr, EVEN_K: tl.constexpr,
             DT: tl.constexpr):
    """Activations transposed, [BLOCK_K, BLOCK_M], at inputs k0.. of the rows starting at `x_cols` [1, BLOCK_M];
    for 4-bit weights the even and odd inputs apart (matching the low and high nibbles), else the tile twice."""
    if PACKED:
        ks = k0 + 2 * tl.arange(0, BLOCK_K // 2)[:, None]
        ok = x_ok if EVEN_K else x_ok & (ks < K)
        x0 = tl.load(x_cols + ks, mask=ok, other=0.0).to(DT)
        x1 = tl.load(x_cols + ks + 1, mask=ok, other=0.0).to(DT)
    else:
        ks = k0 + tl.arange(0, BLOCK_K)[:, None]
        x0 = tl.load(x_cols + ks, mask=x_ok if EVEN_K else x_ok & (ks < K), other=0.0).to(DT)
        x1 = x0
    return x0, x1


@triton.jit
def _dot(acc, w, x, PRECISION: tl.constexpr):
    return tl.dot(w, x, acc, input_precision=PRECISION)


# The GEMMs compute their tiles transposed, [features, slots] = weights [features, K] @ activations^T [K, slots]: the
# weights are the left operand, which Hopper's wgmma takes from registers, so 4-bit weights go from their
# dequantization in registers straight into the product; and decode's 16 slots a block are the narrow side.

@triton.jit
def moe_gate_up_kernel(x_ptr, w_ptr, ws_ptr, wo_ptr, bias_ptr, slots_ptr, ends_ptr, out_ptr, num_pairs,
                       stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_sg, stride_be, alpha, limit,
                       E: tl.constexpr, E_PAD: tl.constexpr, TOP_K: tl.constexpr, K: tl.constexpr,
                       I: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       FORMAT: tl.constexpr, ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr,
                       EVEN_K: tl.constexpr, PRECISION: tl.constexpr, ASM: tl.constexpr):
    """Program (block of BLOCK_M slots, BLOCK_N intermediate features): act(gate x + b, up x + b) of the block's
    tokens x with its expert's gate rows n and up rows I + n, stored to out [slots, I] in out's dtype."""
    pid = tl.program_id(0)
    NUM_N: tl.constexpr = (I + BLOCK_N - 1) // BLOCK_N
    pid_m = pid // NUM_N
    pid_n = pid % NUM_N
    row0 = pid_m * BLOCK_M
    e, total = _block_expert(ends_ptr, row0, E, E_PAD)
    if row0 >= total:
        return
    DT: tl.constexpr = out_ptr.dtype.element_ty
    rows = row0 + tl.arange(0, BLOCK_M)
    pairs = tl.load(slots_ptr + rows)
    valid = pairs < num_pairs
    x_cols = x_ptr + (pairs // TOP_K).to(tl.int64)[None, :] * stride_x
    x_ok = valid[None, :]
    feats = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    in_feats = (feats % I)[:, None]  # in bounds; the features past I are not stored
    e64 = e.to(tl.int64)
    g_rows = w_ptr + e64 * stride_we + in_feats.to(tl.int64) * stride_wn
    u_rows = g_rows + I * stride_wn
    gs_rows = ws_ptr + e64 * stride_se + in_feats * stride_sn
    us_rows = gs_rows + I * stride_sn
    go_rows = wo_ptr + e64 * stride_se + in_feats * stride_sn
    uo_rows = go_rows + I * stride_sn
    PACKED: tl.constexpr = FORMAT != DENSE
    acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if PACKED:  # 4-bit tiles are loaded one step ahead, into registers (the pipeliner stages only dot operands)
        qg, sg, og = _load_packed(g_rows, gs_rows, go_rows, stride_sg, 0, K, BLOCK_K, FORMAT)
        qu, su, ou = _load_packed(u_rows, us_rows, uo_rows, stride_sg, 0, K, BLOCK_K, FORMAT)
    for k0 in range(0, K, BLOCK_K):
        x0, x1 = _load_xt(x_cols, x_ok, k0, K, BLOCK_K, PACKED, EVEN_K, DT)
        if PACKED:
            next_g = _load_packed(g_rows, gs_rows, go_rows, stride_sg, k0 + BLOCK_K, K, BLOCK_K, FORMAT)
            next_u = _load_packed(u_rows, us_rows, uo_rows, stride_sg, k0 + BLOCK_K, K, BLOCK_K, FORMAT)
            g0, g1 = _dequantize(qg, sg, og, BLOCK_N, BLOCK_K, FORMAT, DT, ASM)
            u0, u1 = _dequantize(qu, su, ou, BLOCK_N, BLOCK_K, FORMAT, DT, ASM)
            acc_g = _dot(acc_g, g0, x0, PRECISION)
            acc_u = _dot(acc_u, u0, x0, PRECISION)
            acc_g = _dot(acc_g, g1, x1, PRECISION)
            acc_u = _dot(acc_u, u1, x1, PRECISION)
            qg, sg, og = next_g
            qu, su, ou = next_u
        else:
            acc_g = _dot(acc_g, _load_dense(g_rows, k0, K, BLOCK_K, EVEN_K, DT), x0, PRECISION)
            acc_u = _dot(acc_u, _load_dense(u_rows, k0, K, BLOCK_K, EVEN_K, DT), x0, PRECISION)
    if HAS_BIAS:
        acc_g += tl.load(bias_ptr + e64 * stride_be + in_feats).to(tl.float32)
        acc_u += tl.load(bias_ptr + e64 * stride_be + I + in_feats).to(tl.float32)
    if ACTIVATION == SWIGLU_CLAMP:  # gpt-oss: gate clamped above, up both ways, (up + 1) * gate * sigmoid(alpha gate)
        gate = tl.minimum(acc_g, limit)
        up = tl.minimum(tl.maximum(acc_u, -limit), limit)
        act = gate / (1.0 + tl.exp(-alpha * gate)) * (up + 1.0)
    else:
        act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    tl.store(out_ptr + rows.to(tl.int64)[None, :] * I + feats[:, None], act.to(DT),
             mask=valid[None, :] & (feats < I)[:, None])


@triton.jit
def moe_down_kernel(a_ptr, w_ptr, ws_ptr, wo_ptr, bias_ptr, slots_ptr, ends_ptr, weights_ptr, out_ptr, num_pairs,
                    stride_we, stride_wn, stride_se, stride_sn, stride_sg, stride_be,
                    E: tl.constexpr, E_PAD: tl.constexpr, K: tl.constexpr, H: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FORMAT: tl.constexpr,
                    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr, ASM: tl.constexpr):
    """Program (block of BLOCK_M slots, BLOCK_N hidden features): routing weight x (down a + b) of the block's
    activations a [slots, K] with its expert's down rows, stored in float32 to out [pairs, H] at each slot's pair."""
    pid = tl.program_id(0)
    NUM_N: tl.constexpr = (H + BLOCK_N - 1) // BLOCK_N
    pid_m = pid // NUM_N
    pid_n = pid % NUM_N
    row0 = pid_m * BLOCK_M
    e, total = _block_expert(ends_ptr, row0, E, E_PAD)
    if row0 >= total:
        return
    DT: tl.constexpr = a_ptr.dtype.element_ty
    rows = row0 + tl.arange(0, BLOCK_M)
    pairs = tl.load(slots_ptr + rows)
    valid = pairs < num_pairs
    a_cols = a_ptr + rows.to(tl.int64)[None, :] * K
    a_ok = valid[None, :]  # padding slots' activations were never written
    feats = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    in_feats = (feats % H)[:, None]
    e64 = e.to(tl.int64)
    w_rows = w_ptr + e64 * stride_we + in_feats.to(tl.int64) * stride_wn
    s_rows = ws_ptr + e64 * stride_se + in_feats * stride_sn
    o_rows = wo_ptr + e64 * stride_se + in_feats * stride_sn
    PACKED: tl.constexpr = FORMAT != DENSE
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if PACKED:
        q, sc, of = _load_packed(w_rows, s_rows, o_rows, stride_sg, 0, K, BLOCK_K, FORMAT)
    for k0 in range(0, K, BLOCK_K):
        a0, a1 = _load_xt(a_cols, a_ok, k0, K, BLOCK_K, PACKED, EVEN_K, DT)
        if PACKED:
            next_w = _load_packed(w_rows, s_rows, o_rows, stride_sg, k0 + BLOCK_K, K, BLOCK_K, FORMAT)
            w0, w1 = _dequantize(q, sc, of, BLOCK_N, BLOCK_K, FORMAT, DT, ASM)
            acc = _dot(acc, w0, a0, PRECISION)
            acc = _dot(acc, w1, a1, PRECISION)
            q, sc, of = next_w
        else:
            acc = _dot(acc, _load_dense(w_rows, k0, K, BLOCK_K, EVEN_K, DT), a0, PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + e64 * stride_be + in_feats).to(tl.float32)
    routing = tl.load(weights_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
    tl.store(out_ptr + pairs.to(tl.int64)[None, :] * H + feats[:, None], acc * routing[None, :],
             mask=valid[None, :] & (feats < H)[:, None])


@triton.jit
def moe_sum_kernel(parts_ptr, ids_ptr, out_ptr, E: tl.constexpr, TOP_K: tl.constexpr, H: tl.constexpr,
                   BLOCK_H: tl.constexpr):
    """Program (token, BLOCK_H features): the sum of its TOP_K weighted expert outputs parts [pairs, H] (float32),
    in order of k, pairs of no expert of this stack skipped; rounded once to out's dtype."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = cols < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        e = tl.load(ids_ptr + t * TOP_K + j)
        routed = (e >= 0) & (e < E)
        acc += tl.load(parts_ptr + (t * TOP_K + j) * H + cols, mask=ok & routed, other=0.0)
    tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)
