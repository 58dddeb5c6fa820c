"""engine/model/quant/mxfp4.py against the format's references.

(a) a decoder written here from the OCP Microscaling spec (v1.0: E2M1 codes from their sign, exponent and
mantissa bits, the E8M0 scale 2^(e - 127), a byte's two codes as each layout stores them), in float64;
(b) gguf-py's MXFP4 (ggml type 39) quantize and dequantize, and a GGUF file written and read by gguf-py;
(c) transformers' `convert_moe_packed_tensors`, which gpt-oss's safetensors go through.
Scale bytes 0 and 255 follow (b) and (c), which agree: float32 E2M1 * 2^(e - 127), subnormal at 0, 2^127 for the
code 0.5 and inf above at 255 (the spec's NaN for 255 is neither's).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, quants

from engine.model.quant.mxfp4 import Mxfp4Tensor, e8m0_to_float, quantize_mxfp4

ALL_SCALES = torch.arange(256).to(torch.uint8)


def spec_e2m1(code: int) -> float:
    """E2M1 (OCP MX v1.0, 5.3.3): sign bit 3, exponent bits 2-1 with bias 1, mantissa bit 0; exponent 0 is
    subnormal (mantissa * 0.5)."""
    sign = -1.0 if code & 8 else 1.0
    exponent, mantissa = (code >> 1) & 3, code & 1
    magnitude = mantissa * 0.5 if exponent == 0 else 2.0 ** (exponent - 1) * (1 + mantissa / 2)
    return sign * magnitude


def spec_value(code: int, scale_byte: int) -> float:
    return spec_e2m1(code) * 2.0 ** (scale_byte - 127)  # float64: exact


def spec_safetensors(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """gpt-oss's blocks [rows, in/32, 16] (byte j: input 2j low nibble, 2j + 1 high) and scales [rows, in/32]."""
    rows, groups, _ = blocks.shape
    out = torch.empty(rows, groups * 32, dtype=torch.float64)
    for r in range(rows):
        for g in range(groups):
            s = int(scales[r, g])
            for j in range(16):
                byte = int(blocks[r, g, j])
                out[r, g * 32 + 2 * j] = spec_value(byte & 15, s)
                out[r, g * 32 + 2 * j + 1] = spec_value(byte >> 4, s)
    return out


def spec_gguf(raw: np.ndarray, n: int) -> torch.Tensor:
    """GGUF MXFP4 bytes (17 a block: the E8M0 byte, then byte j holding input j low and j + 16 high), float64 [n]."""
    out = torch.empty(n, dtype=torch.float64)
    data = raw.reshape(-1, 17)
    for b in range(data.shape[0]):
        s = int(data[b, 0])
        for j in range(16):
            byte = int(data[b, 1 + j])
            out[b * 32 + j] = spec_value(byte & 15, s)
            out[b * 32 + j + 16] = spec_value(byte >> 4, s)
    return out


def random_safetensors(*lead: int, rows: int = 6, groups: int = 2, scales: torch.Tensor | None = None,
                       seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*lead, rows, groups, 16), generator=g).to(torch.uint8)
    if scales is None:
        scales = torch.randint(110, 140, (*lead, rows, groups), generator=g).to(torch.uint8)
    return blocks, scales


def same_values(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal values, infinities and zeros' signs."""
    assert got.shape == want.shape
    assert torch.equal(got, want.to(got.dtype))
    assert torch.equal(got.signbit(), want.to(got.dtype).signbit())


def test_the_sixteen_codes() -> None:
    assert [spec_e2m1(c) for c in range(8)] == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    blocks = torch.arange(256).to(torch.uint8).view(16, 1, 16)  # every byte: every pair of codes
    got = Mxfp4Tensor.from_safetensors_blocks(blocks, torch.full((16, 1), 127, dtype=torch.uint8)).dequantize()
    same_values(got, spec_safetensors(blocks, torch.full((16, 1), 127)))
    assert got[0, 0].item() == 0.0 and not got[0, 0].signbit()  # byte 0: code 0 twice, +0
    assert got[8, 1].item() == 0.0 and got[8, 1].signbit()  # byte 0x80: low nibble 0 (+0), high 8 (-0)
    assert got[8, 2].item() == 0.5  # byte 0x81: low nibble 1, 0.5


def test_every_scale_byte_as_the_spec_and_transformers() -> None:
    """Scale bytes 0..255 with every code: the spec's value in float64, then float32 (overflow to inf at 255)."""
    transformers_mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    blocks = torch.arange(256).to(torch.uint8).repeat(256).view(256, 16, 16)  # [rows, groups, 16]
    scales = ALL_SCALES.view(256, 1).expand(256, 16).contiguous()
    want = spec_safetensors(blocks, scales)
    got = Mxfp4Tensor.from_safetensors_blocks(blocks, scales).dequantize()
    same_values(got, want)
    assert torch.isinf(got[255]).any() and (got[0] != 0).any()  # overflow at the top, subnormals at the bottom
    theirs = transformers_mxfp4.convert_moe_packed_tensors(blocks[None], scales[None], dtype=torch.float32)
    same_values(got, theirs[0].t())


def test_e8m0_scale() -> None:
    assert e8m0_to_float(ALL_SCALES).tolist() == [2.0 ** (e - 127) if e < 255 else float("inf") for e in range(256)]


def test_stacked_safetensors_as_transformers_dequantizes_them() -> None:
    """gpt-oss's [experts, rows, in/32, 16] blocks; transformers returns [experts, in, rows] (its weights' layout)."""
    transformers_mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    blocks, scales = random_safetensors(3, rows=10, groups=3)
    weight = Mxfp4Tensor.from_safetensors_blocks(blocks, scales)
    assert weight.shape == (3, 10, 96) and weight.blocks.shape == (3, 10, 48) and weight.scales.shape == (3, 10, 3)
    theirs = transformers_mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    same_values(weight.dequantize(), theirs.transpose(1, 2))
    for e in range(3):
        same_values(weight.select(e).dequantize(), spec_safetensors(blocks[e], scales[e]))
    assert weight.dequantize(torch.bfloat16).dtype == torch.bfloat16
    same_values(weight.dequantize(torch.bfloat16).float(), weight.dequantize())  # E2M1 * 2^k: exact in bfloat16


def gguf_bytes(raw_blocks: int, seed: int, scale_range: tuple[int, int] = (0, 256)) -> np.ndarray:
    g = np.random.default_rng(seed)
    raw = g.integers(0, 256, (raw_blocks, 17), dtype=np.uint8)
    raw[:, 0] = g.integers(*scale_range, raw_blocks)
    return raw


def test_gguf_blocks_as_the_spec_and_gguf_py() -> None:
    raw = gguf_bytes(4 * 5 * 3, seed=1, scale_range=(0, 255)).reshape(4, 5, 3 * 17)  # [experts, rows, row bytes]
    weight = Mxfp4Tensor.from_gguf_blocks(torch.from_numpy(raw), (4, 5, 96))
    assert weight.shape == (4, 5, 96)
    got = weight.dequantize()
    same_values(got.view(-1), spec_gguf(raw, got.numel()))
    theirs = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.MXFP4))
    assert theirs.shape == got.shape
    assert torch.equal(got, theirs)  # gguf-py's zeros are all +0
    back = weight.to_gguf_blocks()
    assert torch.equal(back, torch.from_numpy(raw))


def test_scale_byte_255_as_gguf_py() -> None:
    raw = gguf_bytes(64, seed=2)
    raw[:, 0] = 255
    got = Mxfp4Tensor.from_gguf_blocks(torch.from_numpy(raw), (2, 1024)).dequantize()
    with np.errstate(over="ignore"):  # 2^127 times codes from 1 up: inf, as ours
        theirs = quants.dequantize(raw.reshape(-1), GGMLQuantizationType.MXFP4)
    assert torch.equal(got.view(-1), torch.from_numpy(theirs))


def test_the_two_layouts_hold_the_same_weights() -> None:
    blocks, scales = random_safetensors(2, rows=7, groups=2, seed=3)
    weight = Mxfp4Tensor.from_safetensors_blocks(blocks, scales)
    again = Mxfp4Tensor.from_gguf_blocks(weight.to_gguf_blocks(), weight.shape)
    assert torch.equal(again.blocks, weight.blocks) and torch.equal(again.scales, weight.scales)
    theirs = quants.dequantize(weight.to_gguf_blocks().numpy(), GGMLQuantizationType.MXFP4)
    assert torch.equal(torch.from_numpy(theirs), weight.dequantize())


def test_quantize_as_gguf_py() -> None:
    g = torch.Generator().manual_seed(4)
    w = torch.randn(3, 16, 128, generator=g) * torch.rand(3, 16, 1, generator=g) * 4
    w[0, 0, :32] = 0                                     # an all-zero block: scale byte 0
    w[0, 1, :32] = torch.arange(32) * 0.25 - 4           # values halfway between codes: ties
    w[0, 2, :32] = -0.0
    w[1, 0, :32] = 2.0 ** 20 * (1 - 2.0 ** -24)          # just below a power of two (float32 log2 rounds up)
    w[1, 1, :32] = torch.linspace(-7.9, 7.9, 32)          # above the top code: clipped
    theirs = quants.quantize(w.numpy(), GGMLQuantizationType.MXFP4)
    ours = quantize_mxfp4(w)
    assert torch.equal(ours.to_gguf_blocks(), torch.from_numpy(theirs))
    assert torch.equal(ours.dequantize(), torch.from_numpy(quants.dequantize(theirs, GGMLQuantizationType.MXFP4)))


def test_representable_values_round_trip() -> None:
    """Dequantized MXFP4 quantizes back to itself: the same bytes where a block's largest code is in E2M1's top
    binade (4 or 6, which fixes the scale), the same values otherwise."""
    blocks, scales = random_safetensors(2, rows=8, groups=4, seed=5)
    blocks[..., 0] = (blocks[..., 0] & 0xF0) | 7  # every block holds a 6
    weight = Mxfp4Tensor.from_safetensors_blocks(blocks, scales)
    again = quantize_mxfp4(weight.dequantize())
    assert torch.equal(again.scales, weight.scales)
    assert torch.equal(again.dequantize(), weight.dequantize())
    zeros = (weight.blocks & 7) == 0  # +0 and -0 quantize to +0; every other code is kept
    assert torch.equal(again.blocks & 15, torch.where(zeros, 0, weight.blocks & 15))
    small, scales = random_safetensors(rows=8, groups=4, seed=6)
    small &= 0x33  # codes 0..3 and their sign bit cleared: at most 1.5, below the top binade
    weight = Mxfp4Tensor.from_safetensors_blocks(small, scales)
    assert torch.equal(quantize_mxfp4(weight.dequantize()).dequantize(), weight.dequantize())


def test_rows_experts_and_cat() -> None:
    blocks, scales = random_safetensors(3, rows=8, groups=2, seed=7)
    weight = Mxfp4Tensor.from_safetensors_blocks(blocks, scales)
    dense = weight.dequantize()
    gate, up = weight.rows(slice(0, None, 2)), weight.rows(slice(1, None, 2))  # gpt-oss's interleaved gate/up
    assert torch.equal(gate.dequantize(), dense[:, 0::2]) and torch.equal(up.dequantize(), dense[:, 1::2])
    fused = Mxfp4Tensor.cat([gate, up])
    assert fused.shape == (3, 8, 64)
    assert torch.equal(fused.dequantize(), torch.cat((dense[:, 0::2], dense[:, 1::2]), dim=1))
    assert torch.equal(weight.rows(torch.tensor([5, 0])).dequantize(), dense[:, [5, 0]])
    assert torch.equal(weight.select(2).dequantize(), dense[2])
    assert torch.equal(weight.narrow(1, 2).dequantize(), dense[1:])
    assert torch.equal(Mxfp4Tensor.stack([weight.select(e) for e in range(3)]).dequantize(), dense)
    assert torch.equal(Mxfp4Tensor.cat([weight.narrow(0, 1), weight.narrow(1, 2)], dim=0).dequantize(), dense)


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="do not match"):
        Mxfp4Tensor(torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        Mxfp4Tensor(torch.zeros(4, 16), torch.zeros(4, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="do not hold"):
        Mxfp4Tensor.from_gguf_blocks(torch.zeros(34, dtype=torch.uint8), (2, 64))
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp4(torch.randn(4, 48))


def test_a_gguf_file_written_by_gguf_py(tmp_path) -> None:
    """An MXFP4 tensor written by gguf-py's writer and read by its reader: GGUF lists dims innermost first."""
    g = torch.Generator().manual_seed(8)
    w = torch.randn(4, 6, 64, generator=g)  # [experts, out, in], as llama.cpp's ffn_*_exps
    path = tmp_path / "experts.gguf"
    writer = GGUFWriter(path, "llama")
    writer.add_tensor("blk.0.ffn_up_exps.weight", quants.quantize(w.numpy(), GGMLQuantizationType.MXFP4),
                      raw_dtype=GGMLQuantizationType.MXFP4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensor = GGUFReader(path).tensors[0]
    assert tensor.tensor_type == GGMLQuantizationType.MXFP4
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    weight = Mxfp4Tensor.from_gguf_blocks(torch.from_numpy(np.array(tensor.data)), shape)
    assert weight.shape == w.shape
    assert torch.equal(weight.dequantize(), quantize_mxfp4(w).dequantize())
