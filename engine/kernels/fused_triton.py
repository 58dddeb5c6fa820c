"""The Triton kernels of `engine.kernels.fused` (what each replaces and why: see that module); imports triton.

Each kernel loads its operands in their own dtype, computes in float32 and rounds to the tensors' dtype wherever
the torch ops it replaces round (`(a * b).to(DT)` where torch would store a bfloat16 intermediate), so that only
reduction orders differ from `engine.kernels.fused_torch`, never the rounding points. Row and cache offsets are
int64: a layer's KV pool passes 2**31 elements on a large GPU.
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _rms_scale(x, HIDDEN: tl.constexpr, eps):
    """1 / sqrt(mean(x^2) + eps) of the float32 row `x` [BLOCK] (padding lanes zero) or of each row of [M, BLOCK]."""
    return tl.rsqrt(tl.sum(x * x, axis=-1) / HIDDEN + eps)


@triton.jit
def add_rms_norm_kernel(x_ptr, residual_ptr, branch_weight_ptr, weight_ptr, normed_ptr, new_residual_ptr,
                        stride_x, stride_r, eps,
                        HIDDEN: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                        NORM_BRANCH: tl.constexpr):
    """Program (row): [rms_norm(x, branch_weight) when NORM_BRANCH] [+ residual, stored, when HAS_RESIDUAL], then
    rms_norm(·, weight) stored to `normed`; both outputs contiguous [rows, HIDDEN]. Every intermediate is rounded
    to x's dtype where the torch ops round it."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < HIDDEN
    DT: tl.constexpr = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if NORM_BRANCH:  # gemma3's post-norm of the attention / MLP output, before the residual add
        branch_w = tl.load(branch_weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        x = (x * _rms_scale(x, HIDDEN, eps) * branch_w).to(DT).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
        summed = (x + r).to(DT)
        tl.store(new_residual_ptr + row * HIDDEN + cols, summed, mask=ok)
        x = summed.to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    y = x * _rms_scale(x, HIDDEN, eps) * w
    tl.store(normed_ptr + row * HIDDEN + cols, y.to(normed_ptr.dtype.element_ty), mask=ok)


@triton.jit
def rope_write_kv_kernel(qk_ptr, v_ptr, cos_ptr, sin_ptr, keys_ptr, values_ptr, slots_ptr, q_out_ptr, k_out_ptr,
                         q_norm_ptr, k_norm_ptr,
                         stride_qkn, stride_qkh, stride_vn, stride_vh, stride_cos, stride_sin,
                         stride_kh, stride_ks, stride_vch, stride_vcs, eps,
                         HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         QK_PAD: tl.constexpr, KV_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
                         D_PAD: tl.constexpr, QK_NORM: tl.constexpr, K_OUT: tl.constexpr):
    """Program (token): its HEADS + KV_HEADS q and k heads [QK_PAD, 2 x HALF_PAD] as two halves, optionally
    RMS-normed per head (QK_NORM), rotated; q heads to `q_out` [N, HEADS, HEAD_DIM], k heads and the token's v
    heads to its cache slot of `keys` / `values` [KV_HEADS, slots, HEAD_DIM]; with K_OUT the k heads also to
    `k_out` [N, KV_HEADS, HEAD_DIM].

    x * cos + roll(x, D/2) * signed_sin: the first half's partner is the second half and vice versa."""
    n = tl.program_id(0).to(tl.int64)
    HALF: tl.constexpr = HEAD_DIM // 2
    DT: tl.constexpr = qk_ptr.dtype.element_ty
    h = tl.arange(0, QK_PAD)
    j = tl.arange(0, HALF_PAD)
    h_ok = h < HEADS + KV_HEADS
    j_ok = j < HALF
    tile_ok = h_ok[:, None] & j_ok[None, :]
    src = qk_ptr + n * stride_qkn + h[:, None] * stride_qkh + j[None, :]
    x1 = tl.load(src, mask=tile_ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=tile_ok, other=0.0).to(tl.float32)
    is_q = h < HEADS
    if QK_NORM:  # qwen3 / gemma3: RMS norm of each head (q_norm's weight on q heads, k_norm's on k heads)
        scale = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM + eps)[:, None]
        w1 = tl.where(is_q[:, None], tl.load(q_norm_ptr + j, mask=j_ok, other=0.0).to(tl.float32)[None, :],
                      tl.load(k_norm_ptr + j, mask=j_ok, other=0.0).to(tl.float32)[None, :])
        w2 = tl.where(is_q[:, None], tl.load(q_norm_ptr + HALF + j, mask=j_ok, other=0.0).to(tl.float32)[None, :],
                      tl.load(k_norm_ptr + HALF + j, mask=j_ok, other=0.0).to(tl.float32)[None, :])
        x1 = (x1 * scale * w1).to(DT).to(tl.float32)
        x2 = (x2 * scale * w2).to(DT).to(tl.float32)
    cos1 = tl.load(cos_ptr + n * stride_cos + j, mask=j_ok, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(cos_ptr + n * stride_cos + HALF + j, mask=j_ok, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(sin_ptr + n * stride_sin + j, mask=j_ok, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(sin_ptr + n * stride_sin + HALF + j, mask=j_ok, other=0.0).to(tl.float32)[None, :]
    # torch rounds x * cos to the dtype, then addcmul adds the partner's product in float32 and rounds once
    out1 = ((x1 * cos1).to(DT).to(tl.float32) + x2 * sin1).to(DT)
    out2 = ((x2 * cos2).to(DT).to(tl.float32) + x1 * sin2).to(DT)

    q_dst = q_out_ptr + n * (HEADS * HEAD_DIM) + h[:, None] * HEAD_DIM + j[None, :]
    q_ok = is_q[:, None] & j_ok[None, :]
    tl.store(q_dst, out1, mask=q_ok)
    tl.store(q_dst + HALF, out2, mask=q_ok)

    slot = tl.load(slots_ptr + n).to(tl.int64)
    kv_head = tl.maximum(h - HEADS, 0).to(tl.int64)
    k_dst = keys_ptr + kv_head[:, None] * stride_kh + slot * stride_ks + j[None, :]
    k_ok = (h_ok & ~is_q)[:, None] & j_ok[None, :]
    tl.store(k_dst, out1.to(keys_ptr.dtype.element_ty), mask=k_ok)
    tl.store(k_dst + HALF, out2.to(keys_ptr.dtype.element_ty), mask=k_ok)
    if K_OUT:
        k_own = k_out_ptr + n * (KV_HEADS * HEAD_DIM) + kv_head[:, None] * HEAD_DIM + j[None, :]
        tl.store(k_own, out1, mask=k_ok)
        tl.store(k_own + HALF, out2, mask=k_ok)

    vh = tl.arange(0, KV_PAD)
    d = tl.arange(0, D_PAD)
    v_ok = (vh < KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    v = tl.load(v_ptr + n * stride_vn + vh[:, None] * stride_vh + d[None, :], mask=v_ok)
    tl.store(values_ptr + vh.to(tl.int64)[:, None] * stride_vch + slot * stride_vcs + d[None, :],
             v.to(values_ptr.dtype.element_ty), mask=v_ok)


@triton.jit
def _exp(x, LIBDEVICE: tl.constexpr):
    """e^x: CUDA's expf (libdevice, what torch's kernels call) on the GPU; tl.exp where libdevice is missing (the
    interpreter)."""
    if LIBDEVICE:
        return libdevice.exp(x)
    return tl.exp(x)


@triton.jit
def _tanh(x, LIBDEVICE: tl.constexpr):
    """tanh: CUDA's tanhf on the GPU; 1 - 2 / (1 + e^(2x)) otherwise (saturating to +-1, never NaN)."""
    if LIBDEVICE:
        return libdevice.tanh(x)
    return 1.0 - 2.0 / (1.0 + tl.exp(2.0 * x))


@triton.jit
def gated_activation_kernel(gate_up_ptr, out_ptr, stride_in, stride_out,
                            FEATURES: tl.constexpr, BLOCK: tl.constexpr, GELU: tl.constexpr,
                            LIBDEVICE: tl.constexpr):
    """Program (row, column block): act(gate) * up of BLOCK columns of [gate | up] rows of 2 x FEATURES, with
    torch's formulas (aten's silu and tanh-gelu CUDA kernels) and its rounding of the activation."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < FEATURES
    DT: tl.constexpr = gate_up_ptr.dtype.element_ty
    src = gate_up_ptr + row * stride_in + cols
    gate = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(src + FEATURES, mask=ok, other=0.0).to(tl.float32)
    if GELU:
        inner = 0.7978845608028654 * (gate + 0.044715 * (gate * gate * gate))
        act = 0.5 * gate * (1.0 + _tanh(inner, LIBDEVICE))
    else:
        act = gate / (1.0 + _exp(-gate, LIBDEVICE))
    out = act.to(DT).to(tl.float32) * up  # torch rounds the activation before the product
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=ok)
