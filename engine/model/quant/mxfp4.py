"""MXFP4 weights (OCP Microscaling formats v1.0): blocks of 32 FP4 E2M1 values that share one E8M0 scale.

A weight is `E2M1(code) * 2^(e - 127)`: a 4-bit code (sign, two exponent bits, one mantissa bit: 0, 0.5, 1, 1.5, 2,
3, 4, 6 and their negatives) and a scale byte `e` per block of 32 inputs. gpt-oss ships its experts this way in
safetensors (`*_blocks` / `*_scales`) and llama.cpp stores them as GGUF type MXFP4; both are read here into one
layout, `Mxfp4Tensor`, without widening the codes, so a model keeps its experts in 4.25 bits a weight.

Scale bytes follow the references rather than the spec's NaN for 0xFF: transformers (`convert_moe_packed_tensors`:
ldexp(value, e - 127)) and ggml (`ggml_e8m0_to_fp32_half`) both compute E2M1 * 2^(e - 127) in float32, so 0 gives
values of 2^-128 and 2^-127 magnitude (subnormal) and 255 gives 2^127 for the code 0.5 and inf from 1 up.
"""
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor

MXFP4_BLOCK = 32  # inputs sharing one scale
GGUF_MXFP4_BLOCK_BYTES = 17  # one E8M0 byte, then 16 bytes of codes
# E2M1 by code: bit 3 the sign, bits 2-1 the exponent (bias 1), bit 0 the mantissa.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def e2m1_table(dtype: torch.dtype = torch.float32, device: torch.device | None = None) -> Tensor:
    """The 16 E2M1 values by code."""
    return torch.tensor(E2M1_VALUES, dtype=dtype, device=device)


def doubled_byte_pairs(dtype: torch.dtype = torch.float32, device: torch.device | None = None) -> Tensor:
    """[256, 2]: a byte of the canonical layout -> twice the E2M1 values of its low and high nibble (integers
    -12..12, -0.0 kept), the factor 2 moved into the scale so that every scale byte's factor is a float32."""
    values = e2m1_table(torch.float32, device) * 2
    byte = torch.arange(256, device=device)
    return torch.stack((values[byte & 15], values[byte >> 4]), dim=-1).to(dtype)


def e8m0_half(scales: Tensor) -> Tensor:
    """uint8 E8M0 -> float32 2^(e - 128), exactly (ggml's GGML_E8M0_TO_FP32_HALF): half the block's scale,
    which float32 holds for every byte, 255 included."""
    e = scales.to(torch.int32)
    # a normal float32's exponent field for e >= 2, the subnormals 2^-127 and 2^-128 below
    return torch.where(e >= 2, (e - 1) << 23, 0x00200000 << e.clamp(max=1)).view(torch.float32)


def e8m0_to_float(scales: Tensor) -> Tensor:
    """uint8 E8M0 -> float32 2^(e - 127) (inf for 255, as ldexp(1, 128))."""
    return e8m0_half(scales) * 2


@dataclass(frozen=True)
class Mxfp4Tensor:
    """MXFP4 weights [..., out, in] (leading dims: experts), in this module's one layout:

    `blocks` uint8 [..., out, in // 2]: inputs 2j and 2j + 1 of a row in the low and high nibble of byte j (the
    safetensors layout with its last two dims merged); `scales` uint8 [..., out, in // 32]: E8M0 bytes.
    """

    blocks: Tensor
    scales: Tensor

    def __post_init__(self) -> None:
        b, s = self.blocks, self.scales
        if b.dtype != torch.uint8 or s.dtype != torch.uint8:
            raise ValueError(f"MXFP4 blocks and scales are uint8, got {b.dtype} and {s.dtype}")
        if b.dim() < 2 or b.shape[:-1] != s.shape[:-1] or b.shape[-1] != s.shape[-1] * (MXFP4_BLOCK // 2):
            raise ValueError(f"MXFP4 blocks {tuple(b.shape)} do not match scales {tuple(s.shape)}")

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.blocks.shape[:-1], self.blocks.shape[-1] * 2))

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    def nbytes(self) -> int:
        return self.blocks.numel() + self.scales.numel()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The weights [..., out, in] as `dtype` (computed exactly in float32, then cast)."""
        pairs = torch.nn.functional.embedding(self.blocks.to(torch.int32), doubled_byte_pairs(device=self.device))
        values = pairs.view(*self.scales.shape, MXFP4_BLOCK) * e8m0_half(self.scales).unsqueeze(-1)
        return values.view(self.shape).to(dtype)

    def map(self, fn: Callable[[Tensor], Tensor]) -> "Mxfp4Tensor":
        """`fn` applied to blocks and scales alike: for what indexes their dims other than the last."""
        return Mxfp4Tensor(fn(self.blocks), fn(self.scales))

    def select(self, expert: int) -> "Mxfp4Tensor":
        """One entry of the leading (expert) dim."""
        if self.blocks.dim() < 3:
            raise ValueError("select takes an expert of a stacked MXFP4 tensor [experts, out, in]")
        return self.map(lambda t: t[expert])

    def narrow(self, start: int, length: int) -> "Mxfp4Tensor":
        """Experts start..start + length of the leading dim (expert parallelism's share)."""
        return self.map(lambda t: t.narrow(0, start, length))

    def rows(self, index: Tensor | slice) -> "Mxfp4Tensor":
        """Output rows `index` (a slice or an index tensor) of every expert: gpt-oss's interleaved gate/up rows
        are `rows(slice(0, None, 2))` and `rows(slice(1, None, 2))`."""
        if isinstance(index, slice):
            return self.map(lambda t: t[..., index, :])
        return self.map(lambda t: t.index_select(-2, index.to(t.device)))

    def columns(self, start: int, stop: int) -> "Mxfp4Tensor":
        """Inputs start..stop of every row, both on block edges (a row-parallel rank's share)."""
        if start % MXFP4_BLOCK or stop % MXFP4_BLOCK:
            raise ValueError(f"MXFP4 columns {start}..{stop} cut a block of {MXFP4_BLOCK}")
        return Mxfp4Tensor(self.blocks[..., start // 2:stop // 2],
                           self.scales[..., start // MXFP4_BLOCK:stop // MXFP4_BLOCK])

    def contiguous(self) -> "Mxfp4Tensor":
        return self.map(Tensor.contiguous)

    def to(self, device: torch.device | str) -> "Mxfp4Tensor":
        return self.map(lambda t: t.to(device))

    @staticmethod
    def cat(parts: Sequence["Mxfp4Tensor"], dim: int = -2) -> "Mxfp4Tensor":
        """Concatenation along the output rows (or, dim=0, the experts)."""
        if dim in (-1, parts[0].blocks.dim() - 1):
            raise ValueError("MXFP4 tensors concatenate along rows or experts, not inputs")
        return Mxfp4Tensor(torch.cat([p.blocks for p in parts], dim), torch.cat([p.scales for p in parts], dim))

    @staticmethod
    def stack(parts: Sequence["Mxfp4Tensor"]) -> "Mxfp4Tensor":
        """Per-expert tensors [out, in] -> one [experts, out, in]."""
        return Mxfp4Tensor(torch.stack([p.blocks for p in parts]), torch.stack([p.scales for p in parts]))

    @classmethod
    def from_safetensors_blocks(cls, blocks: Tensor, scales: Tensor) -> "Mxfp4Tensor":
        """gpt-oss's `*_blocks` uint8 [..., out, in // 32, 16] and `*_scales` uint8 [..., out, in // 32]."""
        if blocks.dim() < 3 or blocks.shape[-1] != MXFP4_BLOCK // 2 or blocks.shape[:-1] != scales.shape:
            raise ValueError(f"MXFP4 safetensors blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} "
                             "should be [..., out, in/32, 16] and [..., out, in/32]")
        return cls(blocks.to(torch.uint8).reshape(*blocks.shape[:-2], -1), scales.to(torch.uint8))

    @classmethod
    def from_gguf_blocks(cls, raw: Tensor, shape: Sequence[int]) -> "Mxfp4Tensor":
        """GGUF's MXFP4 data (ggml type 39, any uint8 view of it) for weights of `shape` [..., out, in] (torch's
        order): 17-byte blocks, the E8M0 byte then 16 bytes whose byte j holds input j in its low nibble and
        input j + 16 in its high one."""
        shape = tuple(int(d) for d in shape)
        if shape[-1] % MXFP4_BLOCK:
            raise ValueError(f"MXFP4 rows are whole blocks of {MXFP4_BLOCK}, got shape {shape}")
        n_blocks = raw.numel() // GGUF_MXFP4_BLOCK_BYTES
        if raw.numel() != n_blocks * GGUF_MXFP4_BLOCK_BYTES or n_blocks * MXFP4_BLOCK != _numel(shape):
            raise ValueError(f"{raw.numel()} bytes of GGUF MXFP4 do not hold weights of shape {shape}")
        data = raw.reshape(n_blocks, GGUF_MXFP4_BLOCK_BYTES)
        codes = data[:, 1:]
        in_order = torch.cat((codes & 15, codes >> 4), dim=-1)  # [blocks, 32]: inputs 0..31
        pairs = in_order[:, 0::2] | (in_order[:, 1::2] << 4)
        lead = shape[:-1]
        return cls(pairs.reshape(*lead, shape[-1] // 2).contiguous(),
                   data[:, 0].reshape(*lead, shape[-1] // MXFP4_BLOCK).contiguous())

    def to_gguf_blocks(self) -> Tensor:
        """The GGUF MXFP4 bytes of these weights, uint8 [..., out, in // 32 * 17] (gguf-py's quantized shape)."""
        pairs = self.blocks.reshape(-1, MXFP4_BLOCK // 2)
        in_order = torch.stack((pairs & 15, pairs >> 4), dim=-1).reshape(-1, MXFP4_BLOCK)
        codes = in_order[:, :16] | (in_order[:, 16:] << 4)
        data = torch.cat((self.scales.reshape(-1, 1), codes), dim=-1)
        return data.reshape(*self.scales.shape[:-1], -1)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# Doubled E2M1 values in code order, the candidates the quantizer picks among (ggml's kvalues_mxfp4): the first
# of two equally near ones wins, so ties go to the smaller magnitude and 0 to +0, as in ggml.
_DOUBLED_CANDIDATES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def quantize_mxfp4(w: Tensor, blocks_per_chunk: int = 8192) -> Mxfp4Tensor:
    """Round-to-nearest MXFP4 of a float [..., in] tensor (in a multiple of 32), as ggml's quantizer
    (quantize_row_mxfp4_ref; gguf-py's MXFP4.quantize): the scale 2^(floor(log2(max|x|)) - 2), so the block's
    largest value lands in E2M1's top binade (4..6, clipped at 6), and each value the nearest code.

    The floor is of float32's log2 as in ggml, which rounds up just below a power of two. A block whose max is
    below 2^-125 (where ggml's byte wraps around) gets the scale byte 0.
    """
    if w.dim() < 2 or w.shape[-1] % MXFP4_BLOCK:
        raise ValueError(f"MXFP4 needs [..., out, in] with in a multiple of {MXFP4_BLOCK}, got {tuple(w.shape)}")
    flat = w.reshape(-1, MXFP4_BLOCK)  # rows are whole blocks, so the blocks of all rows in order
    pairs = torch.empty(flat.shape[0], MXFP4_BLOCK // 2, dtype=torch.uint8)
    scales = torch.empty(flat.shape[0], dtype=torch.uint8)
    candidates = torch.tensor(_DOUBLED_CANDIDATES, dtype=torch.float32)
    for start in range(0, flat.shape[0], blocks_per_chunk):
        part = flat[start:start + blocks_per_chunk].float()
        amax = part.abs().amax(-1)
        e = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2 + 127, torch.zeros_like(amax))
        e = e.clamp(0, 254).to(torch.uint8)
        errors = (e8m0_half(e)[:, None, None] * candidates - part.unsqueeze(-1)).abs()
        codes = errors.argmin(-1).to(torch.uint8)  # the first minimum: ties broken as ggml's loop does
        pairs[start:start + blocks_per_chunk] = codes[:, 0::2] | (codes[:, 1::2] << 4)
        scales[start:start + blocks_per_chunk] = e
    lead = w.shape[:-1]
    return Mxfp4Tensor(pairs.view(*lead, -1), scales.view(*lead, -1))
