"""The Triton kernel of `engine.kernels.gemv` (why and when it runs: see that module); imports triton."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def gemv_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, N, stride_wn, K: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr):
    """Program (BLOCK_N output features) of y [1, N] = x [1, K] @ w [N, K]^T (+ bias): the products summed in
    float32 lanes along the whole of K, reduced once, rounded once to y's dtype. No split of K: one launch, and
    nothing depends on the other programs. K is a constant of each layer shape (a handful of compilations a
    model), so the loop over it is unrolled."""
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    col_ok = cols < N
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * stride_wn + ks[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptr + k + ks)
            w = tl.load(w_ptrs, mask=col_ok[:, None], other=0.0)
        else:
            k_ok = (k + ks) < K
            x = tl.load(x_ptr + k + ks, mask=k_ok, other=0.0)
            w = tl.load(w_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        w_ptrs += BLOCK_K
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + cols, y.to(y_ptr.dtype.element_ty), mask=col_ok)
