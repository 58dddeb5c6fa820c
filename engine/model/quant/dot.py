"""Quantized linears by integer dot products: int4 / int8 weights times activations quantized to int8 per block.

The kernels are engine/kernels/csrc/int8_dot.cpp (AVX-512 VNNI); this module packs weights into their tile layout and
swaps them in for the linears of engine/model/quant/formats.py where they serve: a bfloat16 model on a CPU that has VNNI and the
compiled kernels. The float32 path keeps torch's kernels, whose activations are not rounded to 8 bits, so that it
stays the exact reference the tests hold the other paths to. Measured against torch's kernels in
bench/matmul_formats.py; the quality guard (tests/engine/model/quant/test_quantized.py) covers the activation rounding.
"""
# No `from __future__ import annotations`: TorchScript reads the linears' annotations as types.
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.kernels import cpu as cpu_kernels
from engine.model.quant.formats import GROUP_SIZE, Affine4Bit, PackedLinear

TILE = 16  # output rows per tile: one int32 lane each


def dot_kernels_serve(dtype: torch.dtype) -> bool:
    """Whether the integer-dot-product linears replace torch's packed ones for a model of `dtype` on this CPU."""
    return dtype == torch.bfloat16 and cpu_kernels.available() and bool(torch.ops.emberserve.int8_dot_supported())


def dense_copies_pay(dtype: torch.dtype) -> bool:
    """Whether packed layers should keep a bfloat16 copy for prefill: where the dot kernels serve, prompts run as
    fast through them as through a dense bfloat16 matmul on AVX-512 (bench/matmul_formats.py), so the copy would
    only cost memory; with AMX, oneDNN's bfloat16 matmul is several times faster than either."""
    return not dot_kernels_serve(dtype) or "amx_bf16" in cpu_kernels.cpu_flags()


def _tiles_of_steps(codes: Tensor) -> Tensor:
    """uint8 [out, in] (out a multiple of TILE) -> [tiles, in // 32, 8, TILE, 4]: per tile and block, 8 steps of
    4 inputs, each step 16 rows x 4 consecutive inputs (one int32 lane per row)."""
    out_f, in_f = codes.shape
    return codes.view(out_f // TILE, TILE, in_f // GROUP_SIZE, 8, 4).permute(0, 2, 3, 1, 4)


def _pad_rows(t: Tensor, rows: int) -> Tensor:
    return F.pad(t, (0, 0, 0, rows - t.shape[0])) if t.shape[0] != rows else t


def pack_int4(weight: Affine4Bit) -> Tensor:
    """The int4 kernel's layout, uint8 [tiles, in // 32, 320]: per tile and block, codes then float16 d and m."""
    out_f, in_f = weight.shape
    rows = -(-out_f // TILE) * TILE
    steps = _tiles_of_steps(_pad_rows(weight.codes, rows))
    codes = (steps[:, :, :4] | (steps[:, :, 4:] << 4)).reshape(rows // TILE, in_f // GROUP_SIZE, 256)

    def per_tile(t: Tensor) -> Tensor:  # float [out, blocks] -> the bytes of float16 [tiles, blocks, 16]
        t = _pad_rows(t, rows).to(torch.float16).view(rows // TILE, TILE, -1).transpose(1, 2).contiguous()
        return t.view(torch.uint8).view(rows // TILE, in_f // GROUP_SIZE, 2 * TILE)

    return torch.cat((codes, per_tile(weight.scale), per_tile(weight.offset)), dim=-1).contiguous()


def unpack_int4(packed: Tensor, out_features: int) -> Affine4Bit:
    """The weights `pack_int4` packed (scales and offsets as their float16 values)."""
    tiles, blocks, _ = packed.shape
    steps = packed[..., :256].reshape(tiles, blocks, 4, TILE, 4)
    codes = torch.cat((steps & 15, steps >> 4), dim=2).permute(0, 3, 1, 2, 4).reshape(tiles * TILE, blocks * GROUP_SIZE)

    def rows(t: Tensor) -> Tensor:
        return t.contiguous().view(torch.float16).view(tiles, blocks, TILE).transpose(1, 2).reshape(-1, blocks).float()

    return Affine4Bit(codes[:out_features].contiguous(), rows(packed[..., 256:288])[:out_features],
                      rows(packed[..., 288:])[:out_features])


def pack_int8(codes: Tensor) -> Tensor:
    """The int8 kernel's layout, uint8 [tiles, in // 32, 512]: codes + 128, 8 steps of 16 rows x 4 inputs."""
    out_f, in_f = codes.shape
    rows = -(-out_f // TILE) * TILE
    shifted = (_pad_rows(codes, rows).to(torch.int16) + 128).to(torch.uint8)
    return _tiles_of_steps(shifted).reshape(rows // TILE, in_f // GROUP_SIZE, 512).contiguous()


def int8_rows(packed: Tensor, ids: Tensor) -> Tensor:
    """Rows `ids` of the int8 codes `pack_int8` packed, as int8 [*ids.shape, in] (an embedding lookup)."""
    tiles, blocks, _ = packed.shape
    steps = packed.view(tiles, blocks, 8, TILE, 4)
    flat = ids.reshape(-1)
    rows = steps[flat // TILE, :, :, flat % TILE]  # [n, blocks, 8, 4]
    return (rows.to(torch.int16) - 128).to(torch.int8).reshape(*ids.shape, blocks * GROUP_SIZE)


class Int4DotLinear(PackedLinear):
    """Int4Linear's weights in the integer-dot-product kernel's layout."""

    def __init__(self, weight: Affine4Bit, bias: Optional[Tensor], dtype: torch.dtype, keep_dense: bool = False) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", pack_int4(weight))
        self.register_buffer("bias", None if bias is None else bias.to(dtype))
        dense = None
        if keep_dense:  # from the packed (float16) scales and offsets, so both paths use the same weights
            dense = unpack_int4(self.weight, self.out_features).dequantize().to(dtype)
        self.register_buffer("dense", dense)

    def packed_matmul(self, x: Tensor) -> Tensor:
        return torch.ops.emberserve.int4_dot_matmul(x, self.weight, self.out_features)


class Int8DotLinear(PackedLinear):
    """Int8Linear's weights (per-row scales) in the integer-dot-product kernel's layout."""

    def __init__(self, codes: Tensor, scale: Tensor, bias: Optional[Tensor], dtype: torch.dtype,
                 keep_dense: bool = False) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.register_buffer("weight", pack_int8(codes))
        self.register_buffer("scale", _pad_rows(scale.float().unsqueeze(1), self.weight.shape[0] * TILE).reshape(-1))
        self.register_buffer("bias", None if bias is None else bias.to(dtype))
        dense = (codes.float() * scale.float().unsqueeze(1)).to(dtype) if keep_dense else None
        self.register_buffer("dense", dense)

    def packed_matmul(self, x: Tensor) -> Tensor:
        return torch.ops.emberserve.int8_dot_matmul(x, self.weight, self.scale, self.out_features)


class Int8DotEmbedding(torch.nn.Module):
    """An embedding reading a tied Int8DotLinear's table: one copy in memory for the lookup and the output matmul."""

    def __init__(self, head: Int8DotLinear, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("weight", head.weight)
        self.register_buffer("scale", head.scale.to(dtype))
        self.dtype = dtype

    def forward(self, ids: Tensor) -> Tensor:
        return int8_rows(self.weight, ids).to(self.dtype) * self.scale[ids].unsqueeze(-1)
