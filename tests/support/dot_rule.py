"""The rule of the integer-dot-product kernels (engine/kernels/csrc/int8_dot.cpp), brute force in float64.

Each row of activations is cut into blocks of 32 inputs; a block is rounded to int8 codes, round(x * (127 / max|x|))
in float32 (half to even), with the scale max|x| / 127; each output is the sum over blocks of scale * (dot
product of the codes with the block's weights). A kernel may differ from it only by float32 rounding.
"""
from __future__ import annotations

import torch

BLOCK = 32


def quantized_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule's activation codes [M, in] (float64 integers) and per-block scales [M, in // 32]."""
    blocks = x.float().view(x.shape[0], -1, BLOCK)
    top = blocks.abs().amax(-1)
    inverse = torch.where(top > 0, 127 / top, 0)  # float32, as the kernel: codes = round(x * (127 / max))
    codes = torch.round(blocks * inverse.unsqueeze(-1))  # round half to even
    return codes.view(x.shape).double(), (top / 127).double()


def dot_rule_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, in] times `weight` [out, in] (float64, the weights' block scales folded in) under the rule: [M, out]."""
    codes, scale = quantized_activations(x)
    m, blocks = scale.shape
    per_block = torch.einsum("mbk,obk->mob", codes.view(m, blocks, BLOCK),
                             weight.double().view(weight.shape[0], blocks, BLOCK))
    return (per_block * scale.unsqueeze(1)).sum(-1)
