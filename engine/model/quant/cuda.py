"""int4 group-wise linears on CUDA, through torch's tinygemm kernel (`_weight_int4pack_mm`), bfloat16 activations.

The weights are quant.Affine4Bit's, the numbers the CPU's Int4Linear computes with: (code - 8) * scale + zero
for each group of GROUP_SIZE inputs of a row. A decode step of a few rows reads a quarter of the bytes of a
bfloat16 layer, which is what a draft model on a GPU (`--draft-model self-int4`) is for.
"""
# No `from __future__ import annotations`, as in quant.py (its linears' annotations are TorchScript types).
import torch
import torch.nn.functional as F
from torch import Tensor

from engine.model.quant.formats import GROUP_SIZE, Affine4Bit, PackedLinear, kernel_dense_weights

_ROW_MULTIPLE = 8  # tinygemm's output tiles: rows are padded to a multiple and sliced off the output


def inner_k_tiles(in_features: int) -> int:
    """The widest tiling of the input dimension tinygemm accepts (it needs in_features % (16 * tiles) == 0)."""
    for tiles in (8, 4, 2):
        if in_features % (16 * tiles) == 0:
            return tiles
    raise ValueError(f"int4 on CUDA needs the input size to be a multiple of 32, got {in_features}")


def pack_int4_cuda(codes: Tensor) -> Tensor:
    """uint8 codes [out, in] (0..15, on a CUDA device) in tinygemm's layout: two codes a byte, then its tiles."""
    pairs = (codes[:, ::2] << 4 | codes[:, 1::2]).contiguous()  # the even input in the high nibble
    return torch.ops.aten._convert_weight_to_int4pack(pairs, inner_k_tiles(codes.shape[1]))


class Int4CudaLinear(PackedLinear):
    """y = x @ w^T + bias with 4-bit weights in tinygemm's packed layout; optionally a dense copy for prefill."""

    def __init__(self, weight: Affine4Bit, bias: torch.Tensor | None, dtype: torch.dtype, keep_dense: bool,
                 device: torch.device) -> None:
        super().__init__()
        if dtype != torch.bfloat16:
            raise ValueError(f"int4 weights on CUDA compute in bfloat16, not {dtype}")
        self.out_features, self.in_features = weight.shape
        pad = -self.out_features % _ROW_MULTIPLE
        codes, scale, offset = (F.pad(t, (0, 0, 0, pad)).to(device) for t in (weight.codes, weight.scale,
                                                                              weight.offset))
        zero = offset + 8 * scale  # the kernel computes (code - 8) * scale + zero
        self.register_buffer("weight", pack_int4_cuda(codes))
        self.register_buffer("scale_and_zero", torch.stack([scale.t(), zero.t()], dim=-1).to(dtype).contiguous())
        self.register_buffer("bias", None if bias is None else bias.to(device=device, dtype=dtype))
        dense = None
        if keep_dense:
            dense = kernel_dense_weights(codes[:self.out_features], self.scale_and_zero, self.out_features)
        self.register_buffer("dense", dense)

    def packed_matmul(self, x: Tensor) -> Tensor:
        y = torch.ops.aten._weight_int4pack_mm(x.contiguous(), self.weight, GROUP_SIZE, self.scale_and_zero)
        return y[:, :self.out_features] if y.shape[1] != self.out_features else y
