"""Dequantization of ggml tensor types to float32: vectorised torch for the common block types, `gguf` for the rest."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from engine.errors import UnsupportedModelError
from engine.model.quant import GROUP_SIZE, Affine4Bit


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 scale stored at byte `start` of each block, as float32 of shape [..., 1]."""
    return blocks[..., start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    # ggml packs element j in the low nibble and element j + 16 in the high nibble of byte j.
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * b[..., 2:].view(torch.int8).float()


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * (_nibbles(b[..., 2:]).float() - 8.0)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * _nibbles(b[..., 4:]).float() + _f16(b, 2)


def _fifth_bits(qh_bytes: torch.Tensor) -> torch.Tensor:
    """The 32 high bits of a Q5 block (little-endian uint32) as a [..., 32] 0/1 tensor."""
    bits = (qh_bytes.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1
    return bits.reshape(*qh_bytes.shape[:-1], 32)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[..., 6:]) | (_fifth_bits(b[..., 2:6]) << 4)
    return _f16(b, 0) * (q.float() - 16.0)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[..., 8:]) | (_fifth_bits(b[..., 4:8]) << 4)
    return _f16(b, 0) * q.float() + _f16(b, 2)


_TORCH_BLOCK_DEQUANT: dict[Q, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.Q8_0: _q8_0, Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1,
}
_PLAIN = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}


def ggml_type_name(ggml_type: int) -> str:
    try:
        return Q(ggml_type).name
    except ValueError:
        return f"type id {ggml_type}"


def dequantize(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...], tensor_name: str = "") -> torch.Tensor:
    """Turn a tensor's raw bytes ([rows..., bytes per row], uint8) into a float32 torch tensor of `shape`."""
    try:
        qtype = Q(ggml_type)
    except ValueError:
        raise UnsupportedModelError(f"tensor {tensor_name} has unknown ggml type id {ggml_type}") from None
    data = torch.from_numpy(np.array(raw, copy=True).reshape(-1))  # the mmap is read-only
    if qtype in _PLAIN:
        return data.view(_PLAIN[qtype]).float().reshape(shape)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if qtype in _TORCH_BLOCK_DEQUANT:
        blocks = data.reshape(-1, type_size)
        return _TORCH_BLOCK_DEQUANT[qtype](blocks).reshape(shape)
    try:
        from gguf.quants import dequantize as gguf_dequantize

        out = gguf_dequantize(np.ascontiguousarray(raw), qtype)
    except NotImplementedError:
        raise UnsupportedModelError(
            f"tensor {tensor_name} has type {qtype.name}, which emberserve cannot dequantize") from None
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(shape)


def _q4_k_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit sub-block scales and mins of Q4_K blocks ([n, 12] bytes) as float32 [n, 8] each."""
    d, m, md = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mins = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return scales.float(), mins.float()


def _affine_q4_0(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    d = _f16(b, 0)
    return _nibbles(b[..., 2:]), d, -8.0 * d


def _affine_q4_1(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return _nibbles(b[..., 4:]), _f16(b, 0), _f16(b, 2)


def _affine_q4_k(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    scales, mins = _q4_k_scales_mins(b[:, 4:16])
    qs = b[:, 16:].reshape(-1, 4, 1, 32)
    # Each 32-byte chunk holds sub-block 2c in its low nibbles and sub-block 2c + 1 in its high nibbles.
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(-1, 8, 32)
    return codes, (_f16(b, 0) * scales).unsqueeze(-1), (-_f16(b, 2) * mins).unsqueeze(-1)


_AFFINE_4BIT = {Q.Q4_0: _affine_q4_0, Q.Q4_1: _affine_q4_1, Q.Q4_K: _affine_q4_k}


def has_affine_4bit_form(ggml_type: int) -> bool:
    """Whether `affine_4bit` turns matrices of this ggml type into exact `Affine4Bit` codes."""
    try:
        return Q(ggml_type) in _AFFINE_4BIT
    except ValueError:
        return False


def affine_4bit(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> Affine4Bit | None:
    """A 2-D 4-bit tensor (Q4_0, Q4_1, Q4_K) as exact `Affine4Bit` codes, scales and offsets; None for other types."""
    try:
        qtype = Q(ggml_type)
    except ValueError:
        return None
    if qtype not in _AFFINE_4BIT or len(shape) != 2:
        return None
    _, type_size = GGML_QUANT_SIZES[qtype]
    blocks = torch.from_numpy(np.array(raw, copy=True).reshape(-1)).reshape(-1, type_size)
    codes, scale, offset = _AFFINE_4BIT[qtype](blocks)
    rows, cols = shape
    return Affine4Bit(codes.reshape(rows, cols).to(torch.uint8), scale.reshape(rows, cols // GROUP_SIZE).contiguous(),
                      offset.reshape(rows, cols // GROUP_SIZE).contiguous())
