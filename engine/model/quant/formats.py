"""The quantized formats and their modules (the CPU forms): int8 per-channel and int4 group-wise linears, an int8 embedding.

The matmuls are torch's CPU kernels (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`), which are fast with
bfloat16 activations; on CUDA int4 runs through engine/model/quant/cuda.py and int8 through `_weight_int8pack_mm`. 4-bit GGUF blocks (Q4_0, Q4_1, Q4_K) map exactly onto the int4 format; other sources are
quantized round-to-nearest here. The linears are scripted with the rest of the decoder stack (engine/model/layers.py).
"""
# No `from __future__ import annotations`: TorchScript reads the linears' annotations as types.
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.model.layers import DENSE_ROW_BUCKET, dense_matmul

GROUP_SIZE = 32          # input elements sharing one int4 scale/offset (ggml's block and sub-block size)
_INT4_ROW_MULTIPLE = 16  # the int4 CPU kernel packs output rows in tiles of 16


@dataclass
class Affine4Bit:
    """Weights w = codes * scale + offset with 4-bit codes; one scale/offset per GROUP_SIZE inputs of a row."""

    codes: torch.Tensor   # uint8 [out, in], values 0..15
    scale: torch.Tensor   # float32 [out, in // GROUP_SIZE]
    offset: torch.Tensor  # float32 [out, in // GROUP_SIZE]

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def dequantize(self) -> torch.Tensor:
        groups = self.codes.float().view(*self.scale.shape, GROUP_SIZE)
        return (groups * self.scale.unsqueeze(-1) + self.offset.unsqueeze(-1)).view(self.codes.shape)

    def map_rows(self, fn) -> "Affine4Bit":
        """The same weights with `fn` (a row permutation or selection) applied to every part."""
        return Affine4Bit(fn(self.codes), fn(self.scale), fn(self.offset))

    def select(self, expert: int) -> "Affine4Bit":
        """One entry of the leading (expert) dim of a stack [experts, out, in]."""
        return self.map_rows(lambda t: t[expert])

    @staticmethod
    def cat(parts: "list[Affine4Bit]", dim: int = 0) -> "Affine4Bit":
        """Concatenation along output rows (dim 0; dim 1 of stacked experts [E, out, in]), never inputs."""
        return Affine4Bit(*(torch.cat([getattr(p, f) for p in parts], dim) for f in ("codes", "scale", "offset")))


def quantize_4bit(w: torch.Tensor) -> Affine4Bit:
    """Round-to-nearest asymmetric 4-bit quantization of a float [out, in] matrix (in divisible by GROUP_SIZE)."""
    groups = w.float().reshape(w.shape[0], -1, GROUP_SIZE)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp_min(torch.finfo(torch.float32).tiny)
    codes = torch.round((groups - low.unsqueeze(-1)) / scale.unsqueeze(-1)).clamp_(0, 15).to(torch.uint8)
    return Affine4Bit(codes.view(w.shape), scale, low)


def quantize_int8(w: torch.Tensor, rows_per_chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: (codes int8 [out, in], float32 scales [out]) with w ≈ codes * scale.

    Done `rows_per_chunk` rows at a time: whole-matrix temporaries of a 262144-row output projection (gemma3)
    were three float32 copies of it, 2 GiB of load-time peak.
    """
    codes = torch.empty(w.shape, dtype=torch.int8)
    scale = torch.empty(w.shape[0], dtype=torch.float32)
    for start in range(0, w.shape[0], rows_per_chunk):
        part = w[start:start + rows_per_chunk].float()
        s = (part.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
        codes[start:start + rows_per_chunk] = torch.round(part / s.unsqueeze(1)).clamp_(-127, 127)
        scale[start:start + rows_per_chunk] = s
    return codes, scale


def int4_supported(shape) -> bool:
    return len(shape) == 2 and shape[1] % GROUP_SIZE == 0


def int4_matmul(x: torch.Tensor, weight: torch.Tensor, scale_and_zero: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [M, in] @ w^T for int4-packed `weight`, its output rows padded to a multiple of 16 sliced off.
    `scale_and_zero` is [in // group, out, 2], so the group size is implied."""
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, weight, x.shape[1] // scale_and_zero.shape[0], scale_and_zero)
    return y[:, :out_features] if y.shape[1] != out_features else y


class PackedLinear(nn.Module):
    """A linear layer with packed weights; optionally a dense copy of the same (quantized) weights for big calls.

    The packed kernels read few bytes per weight, which is what a decode step of a few rows is bound by; for a
    prefill chunk a dense bfloat16 matmul is faster (bench/matmul_formats.py,
    bench/RESULTS.md#issue-5-cpu-dense-prefill), so a layer given `keep_dense`
    uses its dequantized copy there: the same weights, two bytes more per weight. A call runs its first
    `packed_rows` rows (the batch's decode tokens and short chunks, see batch.ForwardBatch) through the packed
    kernel and the rest through the dense copy, so a token gets the same numbers whatever shares its batch.
    """

    out_features: int
    in_features: int
    bias: Optional[Tensor]
    dense: Optional[Tensor]

    def packed_matmul(self, x: Tensor) -> Tensor:
        """x [M, in] @ w^T with the packed weights."""
        raise NotImplementedError

    def forward(self, x: Tensor, packed_rows: int = 1 << 30, deterministic: bool = False) -> Tensor:
        """x [M, in]; its first `packed_rows` rows take the packed kernel (all of them when there is no dense copy)."""
        dense = self.dense
        m = x.shape[0]
        if dense is None or packed_rows >= m:
            y = self.packed_matmul(x)
        elif packed_rows <= 0:
            y = dense_matmul(x, dense)
        else:
            y = torch.cat((self.packed_matmul(x[:packed_rows]), dense_matmul(x[packed_rows:], dense)))
        bias = self.bias
        return y if bias is None else y + bias


class Int8Linear(PackedLinear):
    """y = x @ (codes * scale)^T + bias, with per-output-channel int8 weights."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                 keep_dense: bool = False) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.register_buffer("weight", codes.contiguous())
        self.register_buffer("scale", scale.to(dtype))
        self.register_buffer("bias", None if bias is None else bias.to(dtype))
        dense = (codes.float() * self.scale.float().unsqueeze(1)).to(dtype) if keep_dense else None
        self.register_buffer("dense", dense)

    def packed_matmul(self, x: Tensor) -> Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.weight, self.scale)


def kernel_dense_weights(codes: Tensor, scale_and_zero: Tensor, out_features: int) -> Tensor:
    """The dense weights [out, in] an int4 kernel computes with: from its own (rounded) scales and zeros
    [in // GROUP_SIZE, rows, 2], so a dense copy and the packed kernel use the same weights."""
    s, z = (scale_and_zero[..., i].t().float().unsqueeze(-1)[:out_features] for i in (0, 1))
    groups = (codes.float() - 8).view(out_features, -1, GROUP_SIZE)
    return (groups * s + z).view(codes.shape).to(scale_and_zero.dtype)


class Int4Linear(PackedLinear):
    """y = x @ w^T + bias with w held as packed 4-bit codes and a scale and zero per group of GROUP_SIZE inputs."""

    def __init__(self, weight: Affine4Bit, bias: torch.Tensor | None, dtype: torch.dtype,
                 keep_dense: bool = False) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        pad = -self.out_features % _INT4_ROW_MULTIPLE  # zero rows, sliced off the output
        codes, scale, offset = (F.pad(t, (0, 0, 0, pad)) for t in (weight.codes, weight.scale, weight.offset))
        # The kernel computes (code - 8) * scale + zero.
        zero = offset + 8 * scale
        self.register_buffer("weight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1))
        self.register_buffer("scale_and_zero", torch.stack([scale.t(), zero.t()], dim=-1).to(dtype).contiguous())
        self.register_buffer("bias", None if bias is None else bias.to(dtype))
        dense = kernel_dense_weights(weight.codes, self.scale_and_zero, self.out_features) if keep_dense else None
        self.register_buffer("dense", dense)

    def packed_matmul(self, x: Tensor) -> Tensor:
        return int4_matmul(x, self.weight, self.scale_and_zero, self.out_features)


class Int8Embedding(nn.Module):
    """Embedding rows stored as per-row int8, dequantized on lookup."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("weight", codes)
        self.register_buffer("scale", scale.to(dtype))
        self.dtype = dtype

    @classmethod
    def sharing(cls, head: "Int8Linear", dtype: torch.dtype) -> "Int8Embedding":
        """An embedding reading the (tied) output projection's int8 table: one copy in memory for both."""
        return cls(head.weight, head.scale, dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight).to(self.dtype) * self.scale[ids].unsqueeze(-1)


def dense_copy_bytes(model: nn.Module) -> int:
    """Memory taken by the packed layers' dense copies."""
    return sum(m.dense.numel() * m.dense.element_size() for m in model.modules()
               if isinstance(m, PackedLinear) and m.dense is not None)
