"""engine/kernels/gemv.py on CUDA (skipped without one; run on the GPU machine): the one-row kernel against an exact product
at the served models' layer shapes, replayed from a CUDA graph, and one-row `Linear` calls taking it."""
from __future__ import annotations

import pytest
import torch

from engine.kernels import gemv
from engine.model import layers
from tests.engine.kernels.test_gemv import is_rounded_product

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")

# (in, out): the llama-1b shape's q/k/v, o, gate/up, down and LM head; gemma3-1b's ragged 1152; a bias-sized odd one.
SHAPES = [(2048, 3072), (2048, 2048), (2048, 16384), (8192, 2048), (2048, 49152), (1152, 6912), (1152, 1024),
          (96, 100)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("in_features,out_features", SHAPES)
def test_gemv_equals_the_exact_product_rounded(in_features, out_features, dtype) -> None:
    torch.manual_seed(in_features + out_features)
    x = torch.randn(1, in_features, device=CUDA).to(dtype)
    w = (torch.randn(out_features, in_features, device=CUDA) / in_features ** 0.5).to(dtype)
    bias = torch.randn(out_features, device=CUDA).to(dtype)
    for b in (None, bias):
        ok = is_rounded_product(gemv.gemv(x, w, b), x, w, b)
        assert ok.all(), f"{int((~ok).sum())} of {ok.numel()} outputs off by more than an ulp"


def test_gemv_replays_from_a_cuda_graph() -> None:
    x = torch.randn(1, 2048, device=CUDA, dtype=torch.bfloat16)
    w = torch.randn(3072, 2048, device=CUDA, dtype=torch.bfloat16) * 0.02
    eager = gemv.gemv(x, w)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        gemv.gemv(x, w)  # compiled before capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = gemv.gemv(x, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, gemv.gemv(x, w)) and not torch.equal(captured, eager)


def test_a_one_row_cuda_linear_takes_the_kernel_and_more_rows_take_torchs() -> None:
    lin = layers.Linear(2048, 2048, bias=True).to(device=CUDA, dtype=torch.bfloat16)
    rows = torch.randn(3, 2048, device=CUDA, dtype=torch.bfloat16)
    assert torch.equal(lin(rows[:1]), gemv.gemv(rows[:1], lin.weight, lin.bias))
    assert torch.equal(lin(rows), torch.nn.functional.linear(rows, lin.weight, lin.bias))
