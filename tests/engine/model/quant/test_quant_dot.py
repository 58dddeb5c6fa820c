"""engine/model/quant/dot.py and its kernels (engine/kernels/csrc/int8_dot.cpp) against a brute-force model of their rule.

The rule: each row of activations is cut into blocks of 32 inputs, a block is rounded to int8 codes, round(x * (127 / max|x|))
in float32 (half to even), with the scale max|x| / 127, each output is the sum over blocks of scale * (integer dot product of the codes
with the weight codes), int4 weights adding their offsets times the block's code sum. The reference computes it
in float64 from the unpacked weights; the kernel may differ only by float32 rounding.
"""
from __future__ import annotations

import pytest
import torch

from engine import load_runner
from engine.model.quant import GROUP_SIZE, Int4Linear, Int8Linear, quantize_4bit, quantize_int8, quantized_linear
from engine.model.quant.dot import (Int4DotLinear, Int8DotEmbedding, Int8DotLinear, dot_kernels_serve, int8_rows,
    pack_int4, unpack_int4)
from tests.support.dot_rule import dot_rule_matmul, quantized_activations

pytestmark = pytest.mark.skipif(not dot_kernels_serve(torch.bfloat16),
                                reason="no AVX-512 VNNI or no compiled CPU kernels here")

SHAPES = [(960, 576), (40, 64), (17, 96), (576, 1536)]  # SmolLM2's, and row counts that are not whole tiles
ROWS = (1, 3, 4, 5, 9)                                   # inside one row tile, a whole one, and past it


def reference(x: torch.Tensor, weight: torch.Tensor, offset: torch.Tensor | None = None) -> torch.Tensor:
    """Brute force: per block, scale times the exact dot product of codes with `weight` [out, in] (per-block
    weight scales folded into `weight`), plus the offset [out, blocks] times scale times the code sum."""
    y = dot_rule_matmul(x, weight)
    if offset is not None:
        codes, scale = quantized_activations(x)
        m, blocks = scale.shape
        y = y + (offset.double().unsqueeze(0) * (scale * codes.view(m, blocks, GROUP_SIZE).sum(-1)).unsqueeze(1)).sum(-1)
    return y


@pytest.mark.parametrize("out_features,in_features", SHAPES)
def test_int4_packing_round_trips(out_features: int, in_features: int) -> None:
    torch.manual_seed(0)
    w = quantize_4bit(torch.randn(out_features, in_features) * 0.05)
    back = unpack_int4(pack_int4(w), out_features)
    assert torch.equal(back.codes, w.codes)
    torch.testing.assert_close(back.scale, w.scale.half().float(), rtol=0, atol=0)  # float16 in the layout
    torch.testing.assert_close(back.offset, w.offset.half().float(), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_features,in_features", SHAPES)
def test_int4_kernel_follows_the_rule(out_features: int, in_features: int, dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    module = Int4DotLinear(quantize_4bit(torch.randn(out_features, in_features) * 0.05), None, torch.bfloat16)
    held = unpack_int4(module.weight, out_features)
    for rows in ROWS:
        x = (torch.randn(rows, in_features) * torch.rand(rows, in_features).pow(4) * 10).to(dtype)  # uneven blocks
        want = reference(x, (held.codes.float().view(out_features, -1, GROUP_SIZE) * held.scale.unsqueeze(-1))
                         .view(out_features, in_features), held.offset)
        got = module.packed_matmul(x)
        assert got.dtype == dtype and got.shape == (rows, out_features)
        tolerance = 1e-5 if dtype == torch.float32 else 8e-3  # float32 sums; bfloat16 outputs
        torch.testing.assert_close(got.double(), want, rtol=tolerance, atol=tolerance * float(want.abs().max()))


@pytest.mark.parametrize("out_features,in_features", SHAPES)
def test_int8_kernel_follows_the_rule(out_features: int, in_features: int) -> None:
    torch.manual_seed(2)
    codes, scale = quantize_int8(torch.randn(out_features, in_features))
    module = Int8DotLinear(codes, scale, None, torch.bfloat16)
    for rows in ROWS:
        x = torch.randn(rows, in_features) * torch.rand(rows, in_features).pow(4) * 10
        want = reference(x, codes.double() * scale.double().unsqueeze(1))
        torch.testing.assert_close(module.packed_matmul(x).double(), want, rtol=1e-5,
                                   atol=1e-5 * float(want.abs().max()))


def test_codes_the_rule_holds_exactly_give_exact_products() -> None:
    """Activations that are int8 codes times a power of two lose nothing: the exact matmul of the held weights."""
    torch.manual_seed(3)
    codes, scale = quantize_int8(torch.randn(48, 128))
    x = torch.randint(-127, 128, (5, 128)).float()
    x[:, ::GROUP_SIZE] = 127  # every block's max is 127: its scale is 1
    want = x.double() @ (codes.double() * scale.double().unsqueeze(1)).t()
    got = Int8DotLinear(codes, scale, None, torch.bfloat16).packed_matmul(x)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-4)


def test_zero_rows_give_zeros_and_bias_is_added() -> None:
    w = quantize_4bit(torch.randn(40, 64))
    bias = torch.randn(40)
    out = Int4DotLinear(w, bias, torch.float32)(torch.zeros(2, 64))
    assert torch.equal(out, bias.expand(2, 40))


def test_embedding_rows_of_the_packed_table() -> None:
    torch.manual_seed(4)
    codes, scale = quantize_int8(torch.randn(50, 64))
    head = Int8DotLinear(codes, scale, None, torch.bfloat16)
    ids = torch.tensor([[0, 49], [17, 17]])
    assert torch.equal(int8_rows(head.weight, ids), codes[ids])
    want = (codes.float() * scale.bfloat16().float().unsqueeze(1))[ids]
    torch.testing.assert_close(Int8DotEmbedding(head, torch.bfloat16)(ids).float(), want, rtol=1e-2, atol=1e-3)


def test_bad_inputs_are_refused() -> None:
    module = Int4DotLinear(quantize_4bit(torch.randn(40, 64)), None, torch.bfloat16)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.emberserve.int4_dot_matmul(torch.randn(2, 48), module.weight, 40)
    with pytest.raises(RuntimeError, match="packed weights"):
        torch.ops.emberserve.int4_dot_matmul(torch.randn(2, 96), module.weight, 40)
    with pytest.raises(RuntimeError, match="out_features"):
        torch.ops.emberserve.int4_dot_matmul(torch.randn(2, 64), module.weight, 49)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.emberserve.int4_dot_matmul(torch.randn(2, 64).half(), module.weight, 40)


def test_the_formats_per_dtype() -> None:
    """bfloat16 models get the dot-product linears; float32 keeps torch's kernels (its activations unrounded)."""
    w = torch.randn(64, 64)
    assert isinstance(quantized_linear(w, None, "int4", torch.bfloat16), Int4DotLinear)
    assert isinstance(quantized_linear(w, None, "int8", torch.bfloat16), Int8DotLinear)
    assert isinstance(quantized_linear(w, None, "int4", torch.float32), Int4Linear)
    assert isinstance(quantized_linear(w, None, "int8", torch.float32), Int8Linear)
    assert isinstance(quantized_linear(torch.randn(64, 48), None, "int8", torch.bfloat16), Int8Linear)  # no blocks


def test_a_loaded_model_shares_its_tied_table(smollm) -> None:
    runner = load_runner("smollm2-135m")
    head, embed = runner.model.lm_head, runner.model.embed_tokens
    assert isinstance(head, Int8DotLinear) and isinstance(embed, Int8DotEmbedding)
    assert embed.weight.data_ptr() == head.weight.data_ptr()
    ids = runner.tokenizer.encode("The capital of France is")
    assert int(runner.prefill_logits(ids).argmax()) == int(smollm.prefill_logits(ids).argmax())
