"""Expert stacks: the weights of all E experts of one projection of a mixture-of-experts layer, in one module.

A stack holds tensors with a leading expert dim (not E submodules), and `matmul(x, expert)` computes
`x @ W_e^T + b_e` for the rows `x` [rows, in] a caller gathered for expert `e`, reading that expert's weights once
however many rows it has. The forms (`ExpertStack` subclasses), by the weights they keep:

- `DenseExperts`: float weights [E, out, in] in the model's dtype.
- `Mxfp4Experts` / `Mxfp4DotExperts`: MXFP4 (engine/model/quant/mxfp4.py) kept in 4.25 bits a weight; the first
  dequantizes the expert's blocks for a dense matmul, the second multiplies them by integer dot products
  (engine/kernels/csrc/int8_dot.cpp) where those serve.
- `Int4Experts` / `Int4DotExperts`, `Int8Experts` / `Int8DotExperts`: the packed weights of engine/model/quant's
  int4 and int8 linears (torch's kernels, or the integer-dot-product ones), each expert packed as its linear
  would be and the packs stacked.

`expert_stack` picks the form for a source, a quantization mode and a dtype, as `quantized_linear` does for a
linear. Sources are a stacked tensor [E, out, in] (float, `Affine4Bit` or `Mxfp4Tensor`) or an iterable of
per-expert [out, in] float tensors or `Affine4Bit`s, packed one at a time: a loader never holds a dense copy of
every expert. The modules are scripted with the decoder stack on CPU (engine/model/layers.py's rules).
"""
# No `from __future__ import annotations`: TorchScript reads the stacks' annotations as types.
from typing import Callable, Iterable, Iterator, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.model.layers import dense_matmul, tiled_matmul
from engine.model.quant import dot as quant_dot
from engine.model.quant.formats import Affine4Bit, int4_matmul, int4_supported, quantize_4bit, quantize_int8
from engine.model.quant.mxfp4 import MXFP4_BLOCK, Mxfp4Tensor, doubled_byte_pairs, e8m0_half, quantize_mxfp4

ExpertWeight = Union[Tensor, Affine4Bit, Mxfp4Tensor]  # one expert's [out, in]
# stacked [E, out, in], or the experts one by one
ExpertSource = Union[Tensor, Affine4Bit, Mxfp4Tensor, Iterable[ExpertWeight]]

_TILE = quant_dot.TILE
_INT4_ROW_MULTIPLE = 16  # torch's int4 CPU kernel packs output rows in tiles of 16 (as formats.Int4Linear)


class ExpertStack(nn.Module):
    """The weights of `num_experts` experts of one projection [out_features, in_features], an optional bias
    [num_experts, out_features]; `matmul(x, expert)` is x [rows, in] @ W_expert^T + b_expert in x's dtype."""

    num_experts: int
    out_features: int
    in_features: int
    bias: Optional[Tensor]

    def _init_stack(self, num_experts: int, out_features: int, in_features: int, bias: Optional[Tensor],
                    dtype: torch.dtype) -> None:
        self.num_experts, self.out_features, self.in_features = num_experts, out_features, in_features
        if bias is not None and tuple(bias.shape) != (num_experts, out_features):
            raise ValueError(f"expert bias {tuple(bias.shape)} is not [{num_experts}, {out_features}]")
        self.register_buffer("bias", None if bias is None else bias.to(dtype).contiguous())

    def expert_matmul(self, x: Tensor, expert: int, deterministic: bool) -> Tensor:
        """x [rows, in] @ W_expert^T, without the bias."""
        raise NotImplementedError

    def dequantize_expert(self, expert: int) -> Tensor:
        """The weights [out, in] expert `expert`'s matmul computes with, as float32."""
        raise NotImplementedError

    def matmul(self, x: Tensor, expert: int, deterministic: bool = False) -> Tensor:
        """x [rows, in] (one expert's gathered rows) @ W_expert^T + b_expert -> [rows, out]. `deterministic`:
        float matmuls in fixed-shape calls (tiled_matmul), so a row's sums do not depend on the row count."""
        y = self.expert_matmul(x, expert, deterministic)
        bias = self.bias
        return y if bias is None else y + bias[expert]

    def forward(self, x: Tensor, expert: int, deterministic: bool = False) -> Tensor:
        return self.matmul(x, expert, deterministic)


def per_expert(source: ExpertSource, num_experts: Optional[int]) -> Tuple[Iterator, int]:
    """The experts of a source one at a time (views of a stacked one), and how many there are."""
    if isinstance(source, Tensor):
        return iter(source.unbind(0)), source.shape[0]
    if isinstance(source, Affine4Bit):
        return (source.select(e) for e in range(source.codes.shape[0])), source.codes.shape[0]
    if isinstance(source, Mxfp4Tensor):
        return (source.select(e) for e in range(source.shape[0])), source.shape[0]
    if num_experts is None:
        source = source if hasattr(source, "__len__") else list(source)
        num_experts = len(source)
    return iter(source), num_experts


def _pack_stack(source: ExpertSource, num_experts: Optional[int],
                pack: Callable[..., Tuple[Tensor, ...]]) -> Tuple[List[Tensor], int, int, int]:
    """`pack` applied to each expert of `source`, its tensors stacked along a new leading dim (allocated once, each
    expert's written in as it comes): (stacked tensors, experts, out_features, in_features)."""
    parts, count = per_expert(source, num_experts)
    stacked: List[Tensor] = []
    shape: Tuple[int, ...] = ()
    done = 0
    for e, w in enumerate(parts):
        if e >= count:
            raise ValueError(f"more than the {count} experts announced")
        packed = pack(w)
        if e == 0:
            shape = tuple(w.shape)
            stacked = [torch.empty((count, *t.shape), dtype=t.dtype) for t in packed]
        elif tuple(w.shape) != shape:
            raise ValueError(f"expert {e} has shape {tuple(w.shape)}, expert 0 {shape}")
        for whole, t in zip(stacked, packed):
            whole[e] = t
        done = e + 1
    if done != count or len(shape) != 2:
        raise ValueError(f"expected {count} experts of [out, in] weights, got {done} of shape {shape}")
    return stacked, count, shape[0], shape[1]


def dense_expert(w: ExpertWeight) -> Tensor:
    """One expert's (or a stack's) weights as float: 4-bit forms dequantized."""
    return w.dequantize() if isinstance(w, (Affine4Bit, Mxfp4Tensor)) else w


def _four_bit(w: ExpertWeight) -> Affine4Bit:
    return w if isinstance(w, Affine4Bit) else quantize_4bit(dense_expert(w))


def _mxfp4(w: ExpertWeight) -> Mxfp4Tensor:
    if isinstance(w, Mxfp4Tensor):
        return w
    return quantize_mxfp4(w.dequantize() if isinstance(w, Affine4Bit) else w)


def _mxfp4_parts(w: ExpertWeight) -> Tuple[Tensor, Tensor]:
    q = _mxfp4(w)
    return q.blocks, q.scales


def float_expert_matmul(x: Tensor, w: Tensor, deterministic: bool) -> Tensor:
    """x @ w^T of one expert's float weights; deterministic: fixed-shape calls, whatever the row count."""
    return tiled_matmul(x, w) if deterministic else dense_matmul(x, w)


class DenseExperts(ExpertStack):
    """Float weights [E, out, in] in the model's dtype."""

    def __init__(self, experts: ExpertSource, bias: Optional[Tensor], dtype: torch.dtype,
                 num_experts: Optional[int] = None) -> None:
        super().__init__()
        (weight,), e, out_f, in_f = _pack_stack(experts, num_experts, lambda w: (dense_expert(w).to(dtype),))
        self._init_stack(e, out_f, in_f, bias, dtype)
        self.register_buffer("weight", weight)

    def expert_matmul(self, x: Tensor, expert: int, deterministic: bool) -> Tensor:
        return float_expert_matmul(x, self.weight[expert], deterministic)

    def dequantize_expert(self, expert: int) -> Tensor:
        return self.weight[expert].float()


class Mxfp4Experts(ExpertStack):
    """MXFP4 weights (Mxfp4Tensor's layout, stacked: blocks [E, out, in / 2], scales [E, out, in / 32]); an
    expert's matmul dequantizes its blocks into x's dtype (exactly, for float32 and bfloat16, whose exponents
    reach every scale) and multiplies densely. Float sources are quantized (quantize_mxfp4)."""

    def __init__(self, experts: ExpertSource, bias: Optional[Tensor], dtype: torch.dtype,
                 num_experts: Optional[int] = None) -> None:
        super().__init__()
        if isinstance(experts, Mxfp4Tensor):  # already stacked: kept as it is
            (blocks, scales), (e, out_f, in_f) = (experts.blocks, experts.scales), tuple(experts.shape)
        else:
            (blocks, scales), e, out_f, in_f = _pack_stack(experts, num_experts, _mxfp4_parts)
        self._init_stack(e, out_f, in_f, bias, dtype)
        self.register_buffer("blocks", blocks.contiguous())
        self.register_buffer("scales", scales.contiguous())
        self.register_buffer("pairs", doubled_byte_pairs())  # byte -> twice its two E2M1 values
        self.register_buffer("halves", e8m0_half(torch.arange(256).to(torch.uint8)))  # E8M0 -> half its scale

    def dequantize_as(self, expert: int, dtype: torch.dtype) -> Tensor:
        """Expert `expert`'s weights [out, in] as `dtype`."""
        exact = dtype == torch.float32 or dtype == torch.bfloat16  # float16 goes through float32
        compute = dtype if exact else torch.float32
        # (Gathering a byte's two values as one int32 is faster, but TorchScript cannot view int32 as bfloat16.)
        values = F.embedding(self.blocks[expert].to(torch.int32), self.pairs.to(compute))  # [out, in / 2, 2]
        half = self.halves.to(compute)[self.scales[expert].to(torch.int64)]  # [out, in / 32]
        w = values.view(half.shape[0], half.shape[1], -1).mul_(half.unsqueeze(-1))  # per block of 32 inputs
        return w.view(self.out_features, self.in_features).to(dtype)

    def expert_matmul(self, x: Tensor, expert: int, deterministic: bool) -> Tensor:
        return float_expert_matmul(x, self.dequantize_as(expert, x.dtype), deterministic)

    def dequantize_expert(self, expert: int) -> Tensor:
        return self.dequantize_as(expert, torch.float32)

    @torch.jit.unused
    def mxfp4(self) -> Mxfp4Tensor:
        """The stacked weights as an Mxfp4Tensor (for the GPU's kernels)."""
        return Mxfp4Tensor(self.blocks, self.scales)


def pack_mxfp4_tiles(weight: Mxfp4Tensor) -> Tensor:
    """One expert's MXFP4 weights [out, in] in the dot kernel's layout, uint8 [tiles, in // 32, 272]: per tile
    of 16 rows and block of 32 inputs, 4 x 64 bytes of codes laid out as the int4 kernel's (row r's 4-byte lane
    of vector c holds inputs 4c..4c+3 in its low nibbles, 16+4c..16+4c+3 in its high ones), then the 16 rows'
    E8M0 bytes. Padding rows are zeros."""
    out_f, in_f = weight.shape
    rows = -(-out_f // _TILE) * _TILE
    codes = torch.stack((weight.blocks & 15, weight.blocks >> 4), dim=-1).view(out_f, in_f)
    codes = F.pad(codes, (0, 0, 0, rows - out_f))
    steps = codes.view(rows // _TILE, _TILE, in_f // MXFP4_BLOCK, 8, 4).permute(0, 2, 3, 1, 4)
    packed_codes = (steps[:, :, :4] | (steps[:, :, 4:] << 4)).reshape(rows // _TILE, in_f // MXFP4_BLOCK, 256)
    scales = F.pad(weight.scales, (0, 0, 0, rows - out_f)).view(rows // _TILE, _TILE, -1).transpose(1, 2)
    return torch.cat((packed_codes, scales), dim=-1).contiguous()


def unpack_mxfp4_tiles(packed: Tensor, out_features: int) -> Mxfp4Tensor:
    """The weights `pack_mxfp4_tiles` packed."""
    tiles, blocks, _ = packed.shape
    steps = packed[..., :256].reshape(tiles, blocks, 4, _TILE, 4)
    codes = torch.cat((steps & 15, steps >> 4), dim=2).permute(0, 3, 1, 2, 4).reshape(tiles * _TILE, -1)
    codes = codes[:out_features]
    scales = packed[..., 256:].transpose(1, 2).reshape(tiles * _TILE, blocks)[:out_features]
    return Mxfp4Tensor((codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous(), scales.contiguous())


class Mxfp4DotExperts(ExpertStack):
    """MXFP4 weights in the integer-dot-product kernel's layout (pack_mxfp4_tiles), [E, tiles, in / 32, 272],
    activations rounded to int8 per block of 32 as Int4DotLinear's (where dot_kernels_serve)."""

    def __init__(self, experts: ExpertSource, bias: Optional[Tensor], dtype: torch.dtype,
                 num_experts: Optional[int] = None) -> None:
        super().__init__()
        (weight,), e, out_f, in_f = _pack_stack(experts, num_experts, lambda w: (pack_mxfp4_tiles(_mxfp4(w)),))
        self._init_stack(e, out_f, in_f, bias, dtype)
        self.register_buffer("weight", weight)

    def expert_matmul(self, x: Tensor, expert: int, deterministic: bool) -> Tensor:
        return torch.ops.emberserve.mxfp4_dot_matmul(x, self.weight[expert], self.out_features)

    @torch.jit.unused
    def dequantize_expert(self, expert: int) -> Tensor:
        return unpack_mxfp4_tiles(self.weight[expert], self.out_features).dequantize()


def _pack_int4_torch(weight: Affine4Bit, dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    """Int4Linear's buffers for one expert: (packed codes, scale_and_zero [in / 32, rows, 2] in `dtype`)."""
    pad = -weight.shape[0] % _INT4_ROW_MULTIPLE  # zero rows, sliced off the output
    codes, scale, offset = (F.pad(t, (0, 0, 0, pad)) for t in (weight.codes, weight.scale, weight.offset))
    zero = offset + 8 * scale  # the kernel computes (code - 8) * scale + zero
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    return packed, torch.stack([scale.t(), zero.t()], dim=-1).to(dtype).contiguous()


class Int4Experts(ExpertStack):
    """Int4Linear's packed weights (torch's `_weight_int4pack_mm_for_cpu`), per expert, stacked: 4-bit sources
    (Affine4Bit: GGUF's Q4_0/Q4_1/Q4_K) exact, float ones quantized (quantize_4bit)."""

    def __init__(self, experts: ExpertSource, bias: Optional[Tensor], dtype: torch.dtype,
                 num_experts: Optional[int] = None) -> None:
        super().__init__()
        (weight, scale_and_zero), e, out_f, in_f = _pack_stack(
            experts, num_experts, lambda w: _pack_int4_torch(_four_bit(w), dtype))
        self._init_stack(e, out_f, in_f, bias, dtype)
        self.register_buffer("weight", weight)
        self.register_buffer("scale_and_zero", scale_and_zero)

    def expert_matmul(self, x: Tensor, expert: int, deterministic: bool) -> Tensor:
        return int4_matmul(x, self.weight[expert], self.scale_and_zero[expert], self.out_features)

    def dequantize_expert(self, expert: int) -> Tensor:
        # the kernel times the identity: its own weights (in its dtype), whatever its packing's layout
        eye = torch.eye(self.in_features, dtype=self.scale_and_zero.dtype)
        return self.expert_matmul(eye, expert, False).t().float()


class Int4DotExperts(ExpertStack):
    """Int4DotLinear's weights (engine/model/quant/dot.py's int4 layout), per expert, stacked."""

    def __init__(self, experts: ExpertSource, bias: Optional[Tensor], dtype: torch.dtype,
                 num_experts: Optional[int] = None) -> None:
        super().__init__()
        (weight,), e, out_f, in_f = _pack_stack(experts, num_experts, lambda w: (quant_dot.pack_int4(_four_bit(w)),))
        self._init_stack(e, out_f, in_f, bias, dtype)
        self.register_buffer("weight", weight)

    def expert_matmul(self, x: Tensor, expert: int, deterministic: bool) -> Tensor:
        return torch.ops.emberserve.int4_dot_matmul(x, self.weight[expert], self.out_features)

    @torch.jit.unused
    def dequantize_expert(self, expert: int) -> Tensor:
        return quant_dot.unpack_int4(self.weight[expert], self.out_features).dequantize()


class Int8Experts(ExpertStack):
    """Int8Linear's weights (per-row int8, torch's `_weight_int8pack_mm`), stacked: codes [E, out, in], scales
    [E, out]. 4-bit sources are dequantized first."""

    def __init__(self, experts: ExpertSource, bias: Optional[Tensor], dtype: torch.dtype,
                 num_experts: Optional[int] = None) -> None:
        super().__init__()

        def pack(w: ExpertWeight) -> Tuple[Tensor, Tensor]:
            codes, scale = quantize_int8(dense_expert(w))
            return codes, scale.to(dtype)

        (weight, scale), e, out_f, in_f = _pack_stack(experts, num_experts, pack)
        self._init_stack(e, out_f, in_f, bias, dtype)
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale)

    def expert_matmul(self, x: Tensor, expert: int, deterministic: bool) -> Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.weight[expert], self.scale[expert])

    def dequantize_expert(self, expert: int) -> Tensor:
        return self.weight[expert].float() * self.scale[expert].float().unsqueeze(1)


class Int8DotExperts(ExpertStack):
    """Int8DotLinear's weights (dot.py's int8 layout and its float32 row scales), per expert, stacked."""

    def __init__(self, experts: ExpertSource, bias: Optional[Tensor], dtype: torch.dtype,
                 num_experts: Optional[int] = None) -> None:
        super().__init__()

        def pack(w: ExpertWeight) -> Tuple[Tensor, Tensor]:
            codes, scale = quantize_int8(dense_expert(w))
            packed = quant_dot.pack_int8(codes)
            rows = packed.shape[0] * _TILE
            return packed, F.pad(scale.float(), (0, rows - scale.shape[0]))

        (weight, scale), e, out_f, in_f = _pack_stack(experts, num_experts, pack)
        self._init_stack(e, out_f, in_f, bias, dtype)
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale)

    def expert_matmul(self, x: Tensor, expert: int, deterministic: bool) -> Tensor:
        return torch.ops.emberserve.int8_dot_matmul(x, self.weight[expert], self.scale[expert], self.out_features)

    @torch.jit.unused
    def dequantize_expert(self, expert: int) -> Tensor:
        rows = quant_dot.int8_rows(self.weight[expert], torch.arange(self.out_features))
        return rows.float() * self.scale[expert][:self.out_features].unsqueeze(1)


def expert_shape(experts: ExpertSource) -> Optional[Tuple[int, int, int]]:
    """[E, out, in] of a stacked source; None for an iterable of experts."""
    if isinstance(experts, (Tensor, Affine4Bit, Mxfp4Tensor)):
        e, out_f, in_f = experts.shape
        return int(e), int(out_f), int(in_f)
    return None


def expert_stack(experts: ExpertSource, bias: Optional[Tensor], mode: str, dtype: torch.dtype,
                 num_experts: Optional[int] = None, in_features: Optional[int] = None) -> ExpertStack:
    """The stack for `experts` in quantization mode `mode` ("none", "int8", "int4") on CPU, as quantized_linear
    picks a linear: MXFP4 sources stay MXFP4 whatever the mode (4 bits, exact); "int4" keeps Affine4Bit sources
    exact and quantizes float ones, "int8" quantizes either, "none" keeps them as float (Affine4Bit dequantized).
    The integer-dot-product forms serve a bfloat16 model on a CPU with AVX-512 VNNI (dot_kernels_serve).
    `in_features` is needed only for an iterable source, for the int4 kernels' multiple-of-32 check."""
    dot = quant_dot.dot_kernels_serve(dtype)
    if isinstance(experts, Mxfp4Tensor):
        return (Mxfp4DotExperts if dot else Mxfp4Experts)(experts, bias, dtype)
    shape = expert_shape(experts)
    width = shape[2] if shape is not None else in_features
    whole_blocks = width is not None and int4_supported((1, width))
    if mode == "int4" and whole_blocks:
        return (Int4DotExperts if dot else Int4Experts)(experts, bias, dtype, num_experts)
    if mode in ("int4", "int8"):
        return (Int8DotExperts if dot and whole_blocks else Int8Experts)(experts, bias, dtype, num_experts)
    if mode != "none":
        raise ValueError(f"unknown quantization mode {mode!r}")
    return DenseExperts(experts, bias, dtype, num_experts)
