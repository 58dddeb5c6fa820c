"""engine/model/quant/experts.py: each expert stack's matmul against its weights' dense reference, the packed forms
against the linears they stack (bit for bit), and the stacks scripted as the decoder stack is.

The references: Affine4Bit's and Mxfp4Tensor's own dequantization (Mxfp4Tensor's is checked against the format's
references in test_mxfp4.py), quantize_int8's codes times scales, and for the integer-dot-product forms the
kernels' rule (tests/support/dot_rule.py).
"""
from __future__ import annotations

from typing import List

import pytest
import torch
from torch import Tensor, nn

from engine.model.quant import Int4Linear, Int8Linear, quantize_4bit, quantize_int8
from engine.model.quant.dot import Int4DotLinear, Int8DotLinear, dot_kernels_serve
from engine.model.quant.experts import (DenseExperts, ExpertStack, Int4DotExperts, Int4Experts, Int8DotExperts,
                                        Int8Experts, Mxfp4DotExperts, Mxfp4Experts, expert_stack, pack_mxfp4_tiles,
                                        unpack_mxfp4_tiles)
from engine.model.quant.formats import Affine4Bit
from engine.model.quant.mxfp4 import Mxfp4Tensor, quantize_mxfp4
from tests.support.dot_rule import dot_rule_matmul

E, OUT, IN = 4, 40, 96  # 40 rows: not whole tiles of 16; 96 inputs: three blocks
ROWS = (1, 3, 17)
needs_dot = pytest.mark.skipif(not dot_kernels_serve(torch.bfloat16),
                               reason="no AVX-512 VNNI or no compiled CPU kernels here")


def weights(seed: int = 0) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, OUT, IN, generator=g) * 0.1


def bias(seed: int = 1) -> Tensor:
    return torch.randn(E, OUT, generator=torch.Generator().manual_seed(seed))


def rows(n: int, dtype: torch.dtype = torch.float32, seed: int = 2) -> Tensor:
    g = torch.Generator().manual_seed(seed + n)
    return (torch.randn(n, IN, generator=g) * torch.rand(n, IN, generator=g).pow(4) * 10).to(dtype)


def stacked_4bit(w: Tensor) -> Affine4Bit:
    parts = [quantize_4bit(w[e]) for e in range(w.shape[0])]
    return Affine4Bit(*(torch.stack([getattr(p, f) for p in parts]) for f in ("codes", "scale", "offset")))


def int8_dense(w: Tensor) -> Tensor:
    codes, scale = quantize_int8(w)
    return codes.double() * scale.double().unsqueeze(1)


def check_float_matmul(stack: ExpertStack, dense: Tensor, b: Tensor) -> None:
    """float32 matmuls: each expert's rows against x @ W_e^T + b_e in float64."""
    assert (stack.num_experts, stack.out_features, stack.in_features) == (E, OUT, IN)
    for n in ROWS:
        x = rows(n)
        for e in range(E):
            want = x.double() @ dense[e].double().t() + b[e].double()
            got = stack.matmul(x, e)
            assert got.dtype == torch.float32 and got.shape == (n, OUT)
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
            torch.testing.assert_close(stack.dequantize_expert(e).double(), dense[e].double(), rtol=1e-6, atol=1e-7)


def test_dense_experts() -> None:
    w, b = weights(), bias()
    check_float_matmul(DenseExperts(w, b, torch.float32), w, b)


def test_mxfp4_experts() -> None:
    q, b = quantize_mxfp4(weights()), bias()
    stack = Mxfp4Experts(q, b, torch.float32)
    assert stack.blocks.data_ptr() == q.blocks.contiguous().data_ptr() or torch.equal(stack.blocks, q.blocks)
    check_float_matmul(stack, q.dequantize(), b)


def test_mxfp4_experts_one_by_one() -> None:
    """Per-expert MXFP4 tensors stack to the same weights; float experts are quantized as quantize_mxfp4 does."""
    w = weights()
    q = quantize_mxfp4(w)
    for stack in (Mxfp4Experts([q.select(e) for e in range(E)], None, torch.float32),
                  Mxfp4Experts(iter(w.unbind(0)), None, torch.float32, num_experts=E)):
        assert torch.equal(stack.blocks, q.blocks) and torch.equal(stack.scales, q.scales)


def test_mxfp4_experts_in_bfloat16_dequantize_exactly() -> None:
    q = quantize_mxfp4(weights())
    stack = Mxfp4Experts(q, None, torch.bfloat16)
    for e in range(E):
        assert torch.equal(stack.dequantize_as(e, torch.bfloat16), q.select(e).dequantize(torch.bfloat16))
        assert torch.equal(stack.dequantize_as(e, torch.float16), q.select(e).dequantize(torch.float16))
    x = rows(3, torch.bfloat16)
    want = x.double() @ q.select(1).dequantize().double().t()
    torch.testing.assert_close(stack.matmul(x, 1).double(), want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))


def test_int4_experts_are_the_int4_linears() -> None:
    """Int4Experts computes what Int4Linear computes for each expert, bit for bit, from a stacked Affine4Bit or
    from one expert at a time."""
    w, b = weights(), bias()
    four = stacked_4bit(w)
    check_float_matmul(Int4Experts(four, b, torch.float32), four.dequantize(), b)
    one_by_one = Int4Experts((quantize_4bit(w[e]) for e in range(E)), b, torch.bfloat16, num_experts=E)
    stacked = Int4Experts(four, b, torch.bfloat16)
    for e in range(E):
        linear = Int4Linear(quantize_4bit(w[e]), b[e], torch.bfloat16)
        x = rows(5, torch.bfloat16)
        assert torch.equal(stacked.matmul(x, e), linear(x))
        assert torch.equal(one_by_one.matmul(x, e), linear(x))


def test_int8_experts_are_the_int8_linears() -> None:
    w, b = weights(), bias()
    check_float_matmul(Int8Experts(w, b, torch.float32), torch.stack([int8_dense(w[e]) for e in range(E)]), b)
    stack = Int8Experts(list(w.unbind(0)), b, torch.bfloat16)  # a list of float experts
    for e in range(E):
        linear = Int8Linear(*quantize_int8(w[e]), b[e], torch.bfloat16)
        x = rows(5, torch.bfloat16)
        assert torch.equal(stack.matmul(x, e), linear(x))


def test_four_bit_sources_in_int8_and_dense_stacks() -> None:
    four, b = stacked_4bit(weights()), bias()
    check_float_matmul(DenseExperts(four, b, torch.float32), four.dequantize(), b)
    dense = torch.stack([int8_dense(four.dequantize()[e]) for e in range(E)])
    check_float_matmul(Int8Experts(four, b, torch.float32), dense, b)


@needs_dot
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dot_stacks_are_the_dot_linears(dtype: torch.dtype) -> None:
    w, b = weights(), bias()
    int4 = Int4DotExperts(stacked_4bit(w), b, dtype)
    int8 = Int8DotExperts(iter(w.unbind(0)), b, dtype, num_experts=E)
    for e in range(E):
        x = rows(6, dtype)
        assert torch.equal(int4.matmul(x, e), Int4DotLinear(quantize_4bit(w[e]), b[e], dtype)(x))
        assert torch.equal(int8.matmul(x, e), Int8DotLinear(*quantize_int8(w[e]), b[e], dtype)(x))
        assert torch.equal(int4.dequantize_expert(e), Int4DotLinear(quantize_4bit(w[e]), None, torch.float32,
                                                                    keep_dense=True).dense)
        torch.testing.assert_close(int8.dequantize_expert(e).double(), int8_dense(w[e]), rtol=1e-6, atol=0)


def test_mxfp4_tile_packing_round_trips() -> None:
    q = quantize_mxfp4(weights()[0])
    packed = pack_mxfp4_tiles(q)
    assert packed.shape == (3, 3, 272)  # 40 rows -> 3 tiles of 16; 96 inputs -> 3 blocks
    back = unpack_mxfp4_tiles(packed, OUT)
    assert torch.equal(back.blocks, q.blocks) and torch.equal(back.scales, q.scales)


@needs_dot
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_dot_kernel_follows_the_rule(dtype: torch.dtype) -> None:
    q, b = quantize_mxfp4(weights()), bias()
    stack = Mxfp4DotExperts(q, b, dtype)
    tolerance = 1e-5 if dtype == torch.float32 else 8e-3  # float32 sums; bfloat16 outputs
    for n in (1, 4, 5, 9):  # inside one row tile, a whole one, and past it
        x = rows(n, dtype)
        for e in range(E):
            want = dot_rule_matmul(x, q.select(e).dequantize().double()) + b[e].to(dtype).double()
            got = stack.matmul(x, e)
            assert got.dtype == dtype and got.shape == (n, OUT)
            torch.testing.assert_close(got.double(), want, rtol=tolerance, atol=tolerance * float(want.abs().max()))
    for e in range(E):
        assert torch.equal(stack.dequantize_expert(e), q.select(e).dequantize())


@needs_dot
@pytest.mark.parametrize("scale_byte,magnitude", [(0, 1e30), (1, 1e30), (2, 1e30), (127, 1.0), (200, 1e-20),
                                                  (254, 1e-30), (255, 1e-30)])
def test_mxfp4_dot_kernel_scale_bytes(scale_byte: int, magnitude: float) -> None:
    """Every E8M0 byte's factor 2^(e - 127), subnormal halves and 255 included, exact where the outputs are
    normal floats (activations sized to keep them so): the rule in float64 from the spec's values."""
    g = torch.Generator().manual_seed(9)
    blocks = torch.randint(0, 256, (1, OUT, IN // 2), generator=g).to(torch.uint8)
    q = Mxfp4Tensor(blocks, torch.full((1, OUT, IN // 32), scale_byte, dtype=torch.uint8))
    codes = torch.stack((blocks[0] & 15, blocks[0] >> 4), dim=-1).view(OUT, IN).long()
    e2m1 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)
    spec = e2m1[codes] * 2.0 ** (scale_byte - 127)
    x = rows(5) * magnitude
    want = dot_rule_matmul(x, spec)
    got = Mxfp4DotExperts(q, None, torch.float32).matmul(x, 0)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


class RunsEveryExpert(nn.Module):
    """A stand-in for the MoE layer: each expert's rows through the stack, as the decoder's scripted code calls it."""

    def __init__(self, stack: ExpertStack) -> None:
        super().__init__()
        self.stack = stack

    def forward(self, x: Tensor, experts: List[int], deterministic: bool) -> Tensor:
        outs: List[Tensor] = []
        for e in experts:
            outs.append(self.stack.matmul(x, e, deterministic))
        return torch.stack(outs)


def stacks(dtype: torch.dtype) -> List[ExpertStack]:
    w, b = weights(), bias()
    made = [DenseExperts(w, b, dtype), Mxfp4Experts(quantize_mxfp4(w), b, dtype), Int4Experts(w, b, dtype),
            Int8Experts(w, b, dtype)]
    if dot_kernels_serve(torch.bfloat16):
        made += [Mxfp4DotExperts(quantize_mxfp4(w), b, dtype), Int4DotExperts(w, b, dtype),
                 Int8DotExperts(w, b, dtype)]
    return made


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stacks_script(dtype: torch.dtype) -> None:
    for stack in stacks(dtype):
        module = RunsEveryExpert(stack)
        scripted = torch.jit.script(module)
        x = rows(5, dtype)
        for deterministic in (False, True):
            assert torch.equal(scripted(x, [3, 0, 1], deterministic), module(x, [3, 0, 1], deterministic)), stack


def test_deterministic_rows_do_not_depend_on_their_count() -> None:
    for stack in (DenseExperts(weights(), None, torch.float32), Mxfp4Experts(quantize_mxfp4(weights()), None,
                                                                               torch.float32)):
        x = rows(40)
        assert torch.equal(stack.matmul(x, 2, True)[:3], stack.matmul(x[:3], 2, True))


def test_expert_stack_picks_the_form() -> None:
    w = weights()
    dot = dot_kernels_serve(torch.bfloat16)
    assert isinstance(expert_stack(quantize_mxfp4(w), None, "none", torch.float32), Mxfp4Experts)
    assert isinstance(expert_stack(quantize_mxfp4(w), None, "int4", torch.bfloat16),
                      Mxfp4DotExperts if dot else Mxfp4Experts)
    assert isinstance(expert_stack(w, None, "int4", torch.float32), Int4Experts)
    assert isinstance(expert_stack(stacked_4bit(w), None, "int4", torch.bfloat16),
                      Int4DotExperts if dot else Int4Experts)
    assert isinstance(expert_stack(w, None, "int8", torch.float32), Int8Experts)
    assert isinstance(expert_stack(w, None, "int8", torch.bfloat16), Int8DotExperts if dot else Int8Experts)
    assert isinstance(expert_stack(w, None, "none", torch.bfloat16), DenseExperts)
    assert isinstance(expert_stack(torch.randn(2, 8, 48), None, "int4", torch.bfloat16), Int8Experts)  # no blocks
    per_expert = expert_stack((quantize_4bit(w[e]) for e in range(E)), None, "int4", torch.float32, num_experts=E,
                              in_features=IN)
    assert isinstance(per_expert, Int4Experts) and per_expert.num_experts == E


def test_bad_sources_are_refused() -> None:
    w = weights()
    with pytest.raises(ValueError, match="expected 4 experts"):
        Int8Experts(iter(w.unbind(0)[:3]), None, torch.float32, num_experts=4)
    with pytest.raises(ValueError, match="shape"):
        DenseExperts([w[0], w[1, :8]], None, torch.float32)
    with pytest.raises(ValueError, match="bias"):
        DenseExperts(w, torch.zeros(E, OUT + 1), torch.float32)
