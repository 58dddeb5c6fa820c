"""engine/kernels/gemv.py: the one-row Triton kernel (run by Triton's CPU interpreter) against an exact float64 product,
at tile-aligned and ragged shapes, with and without a bias; what it refuses; which calls take it.

TRITON_INTERPRET=1 has to be set before the kernel is defined and must not leak into other tests, so the
interpreted calls run in one subprocess (tests/support/interpreted.py). On a GPU: tests/gpu/test_gemv_cuda.py.
"""
from __future__ import annotations

import pytest
import torch

from engine.kernels import gemv
from engine.model import layers
from tests.support.interpreted import run_interpreted

# (in, out, bias, dtype): every tile choice of gemv_config, inputs that no tile divides (masked loads), outputs
# past the last full program (masked stores).
CASES = [
    (512, 64, False, torch.bfloat16),     # 512-wide tiles, 8 features a program, all even
    (1152, 40, True, torch.bfloat16),     # 128-wide tiles (1152 = 9 x 128), a partial last program, bias
    (300, 24, False, torch.float16),      # no tile divides 300: masked loads
    (256, 16392, True, torch.bfloat16),   # a wide output (8 warps), a partial last program
    (2048, 6, False, torch.bfloat16),     # 2,048-wide tiles, 2 features a program
    (4096, 5, True, torch.float16),       # two tiles along the inputs, a half-empty last program
]


def _problem(index: int) -> dict[str, torch.Tensor | None]:
    k, n, bias, dtype = CASES[index]
    gen = torch.Generator().manual_seed(index)
    return {"x": torch.randn(1, k, generator=gen).to(dtype),
            "weight": (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype),
            "bias": torch.randn(n, generator=gen).to(dtype) if bias else None}


_INTERPRETED_CALLS = """
import sys
import torch
from engine.kernels import gemv
calls = torch.load(sys.argv[1])
results = [gemv.gemv(**args) for args in calls]
results.append(gemv.gemv(**calls[0], config=(4, 128, 4)))  # a tile other than gemv_config's
refusals = []
for args in ({"x": torch.zeros(2, 8), "weight": torch.zeros(4, 8)},
             {"x": torch.zeros(1, 8), "weight": torch.zeros(4, 8), "bias": torch.zeros(3)}):
    try:
        gemv.gemv(**args)
        refusals.append(None)
    except ValueError as e:
        refusals.append(str(e))
torch.save((results, refusals), sys.argv[2])
"""


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> tuple[list[torch.Tensor], list[str | None]]:
    return run_interpreted(_INTERPRETED_CALLS, [_problem(i) for i in range(len(CASES))], tmp_path_factory.mktemp("gemv"))


def is_rounded_product(result: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None) -> torch.Tensor:
    """Whether each output is the exact x @ weight^T (+ bias), off by at most float32 summation's error bound
    (inputs x eps32 x sum |x_i w_i|), rounded either way to the output's dtype (the interpreter rounds toward zero,
    the GPU to nearest)."""
    exact = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    summed = x.double().abs() @ weight.double().abs().T + (0 if bias is None else bias.double().abs())
    error = x.shape[-1] * torch.finfo(torch.float32).eps * summed
    magnitude = (exact.abs() + error).clamp_min(1e-30)
    ulp = torch.finfo(result.dtype).eps * torch.exp2(torch.floor(torch.log2(magnitude)))
    return (result.double() - exact).abs() <= ulp + error


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"{k}x{n}{'-bias' if b else ''}-{str(d)[6:]}"
                                                          for k, n, b, d in CASES])
def test_kernel_equals_the_exact_product_rounded(interpreted, index):
    args = _problem(index)
    result = interpreted[0][index]
    assert result.shape == (1, CASES[index][1]) and result.dtype == args["x"].dtype
    ok = is_rounded_product(result, **args)
    assert ok.all(), f"{int((~ok).sum())} of {ok.numel()} outputs off by more than an ulp"


def test_a_tile_given_by_the_caller_computes_the_same_product(interpreted):
    ok = is_rounded_product(interpreted[0][len(CASES)], **_problem(0))
    assert ok.all(), f"{int((~ok).sum())} of {ok.numel()} outputs off by more than an ulp"


def test_kernel_refuses_more_rows_and_a_mismatched_bias(interpreted):
    assert all(interpreted[1]), interpreted[1]


def test_only_one_row_cuda_calls_of_16_bit_weights_in_wide_tiles_take_the_kernel():
    w = torch.zeros(8, 1024, dtype=torch.bfloat16)
    assert not gemv.serves(torch.zeros(1, 1024, dtype=torch.bfloat16), w)  # CPU tensors: torch's linear
    if torch.cuda.is_available():
        wc, x = w.cuda(), torch.zeros(1, 1024, dtype=torch.bfloat16, device="cuda")
        assert gemv.serves(x, wc) == (gemv._kernels is not None)
        assert not gemv.serves(torch.zeros(2, 1024, dtype=torch.bfloat16, device="cuda"), wc)
        assert not gemv.serves(x.float(), wc.float())
        assert not gemv.serves(torch.zeros(1, 8, dtype=torch.bfloat16, device="cuda"), wc.t())
        narrow = torch.zeros(8, 1152, dtype=torch.bfloat16, device="cuda")  # gemma3's hidden size
        assert not gemv.serves(torch.zeros(1, 1152, dtype=torch.bfloat16, device="cuda"), narrow)


def test_a_one_row_cpu_linear_is_torchs():
    lin = layers.Linear(16, 8)
    x = torch.randn(1, 16)
    assert torch.equal(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias))
    assert torch.equal(torch.jit.script(lin)(x), lin(x))
