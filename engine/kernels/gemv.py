"""One-row matrix-vector products on a GPU (Triton), where cuBLAS reads the weights of small layers slowly.

A batch-1 decode step reads every weight once for a single row, so it is bound by memory bandwidth; cuBLAS's
kernels for one row reach a fraction of it on the small projections of a 1B model (q/k/v, o, down), and each
projection runs 16 times a step. `gemv_kernel` spreads the output features over many programs, each walking the
whole input dimension in wide tiles (figures against torch's linear: bench/RESULTS.md#issue-13-gpu-gemv). From two rows
on cuBLAS's matmul is as fast or faster, so only one-row calls take this path, and only where the input dimension
is a multiple of 1,024 (the tiles measured faster).

`Linear` (engine/model/layers.py) calls `serves` and `gemv`; `EMBERSERVE_GEMV=0` keeps every call on torch's linear.
The kernel sums in float32 and rounds once, as cuBLAS does, in another order (an ulp of bfloat16 here and there).
It synchronises nothing and allocates only its output: capturable in CUDA graphs.
"""
# No `from __future__ import annotations`: TorchScript reads `gemv`'s signature (the scripted CPU stack calls Linear).
from typing import Optional, Tuple

import torch
from torch import Tensor

from engine.kernels import switches

try:
    from engine.kernels import gemv_triton as _kernels
except ModuleNotFoundError as e:  # no triton in this environment: torch's linear serves every call
    if e.name != "triton":
        raise
    _kernels = None

_DTYPES = (torch.bfloat16, torch.float16)
MIN_TILE = 1024  # the narrowest input tile `serves` sends here
WIDE_OUTPUT = 16384  # from here on (gate/up, the LM head) 8 warps a program read faster than 4


def gemv_config(out_features: int, in_features: int) -> Tuple[int, int, int]:
    """(BLOCK_N features a program, BLOCK_K inputs a tile, warps), as measured on an H200 at the 1B shape's layers:
    the widest tile up to 2,048 inputs that divides the input dimension (masked loads where none does), 4,096
    weights a tile (2 features at 2,048 inputs: many small programs read a small matrix fastest), 8 warps for wide
    outputs."""
    block_k = next((b for b in (2048, 1024, 512, 256, 128) if in_features % b == 0),
                   min(2048, 1 << max(0, in_features - 1).bit_length()))
    return max(2, 4096 // block_k), block_k, 8 if out_features >= WIDE_OUTPUT else 4


def serves(x: Tensor, weight: Tensor) -> bool:
    """Whether `gemv` takes x [1, in] @ weight^T: one row, a 16-bit CUDA weight with unit column stride, and an
    input dimension that 1,024-wide tiles divide. Narrower tiles were slower than cuBLAS where they were measured
    (gemma3-1b's 1,152 and 6,912 inputs: bench/RESULTS.md#issue-13-gpu-gemv), so those layers keep torch's
    linear."""
    return (_kernels is not None and switches.SWITCHES.gemv and x.is_cuda and x.dim() == 2 and x.shape[0] == 1
            and weight.shape[1] % MIN_TILE == 0 and weight.dtype in _DTYPES and x.dtype == weight.dtype
            and weight.stride(-1) == 1)


@torch.jit.ignore
def gemv(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None,
         config: Optional[Tuple[int, int, int]] = None) -> Tensor:
    """x [1, in] @ weight [out, in]^T (+ bias [out]) → [1, out] in x's dtype (any device Triton runs on: the CPU
    under TRITON_INTERPRET=1, for the tests). `config`: (BLOCK_N, BLOCK_K, warps) instead of `gemv_config`'s (what
    bench/gemv.py --sweep times)."""
    out_features, in_features = weight.shape
    if x.shape != (1, in_features):
        raise ValueError(f"gemv takes one row of {in_features} inputs, got {tuple(x.shape)}")
    if bias is not None and bias.shape != (out_features,):
        raise ValueError(f"bias {tuple(bias.shape)} for {out_features} outputs")
    x = x.contiguous()
    y = torch.empty((1, out_features), dtype=x.dtype, device=x.device)
    block_n, block_k, warps = config if config is not None else gemv_config(out_features, in_features)
    _kernels.gemv_kernel[(-(-out_features // block_n),)](
        x, weight, weight if bias is None else bias, y, out_features, weight.stride(0), K=in_features,
        BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None, EVEN_K=in_features % block_k == 0,
        num_warps=warps)
    return y
