"""engine/layers.py's matmul helpers: the row bucket and the fixed-shape tiles deterministic steps rely on."""
from __future__ import annotations

import pytest
import torch

from engine.layers import DENSE_ROW_BUCKET, tiled_matmul


@pytest.mark.parametrize("inner", [576, 1536, 4096])
def test_a_row_gets_the_same_sums_in_any_call_of_tiles(inner: int) -> None:
    """Row i of a chunk: bit-identical whatever the chunk's length and wherever the row sits in it. At inner 1536
    a plain float32 matmul of 64 rows or more sums differently from one of 48 on an AVX-512 Xeon (MKL's blocking)."""
    torch.manual_seed(0)
    w, x, bias = torch.randn(576, inner), torch.randn(200, inner), torch.randn(576)
    alone = torch.cat([tiled_matmul(x[i:i + 1], w, bias) for i in range(40, 60)])
    for start, length in [(40, 20), (0, 100), (33, 27), (40, 160), (1, 199)]:
        out = tiled_matmul(x[start:start + length], w, bias)
        assert out.shape == (length, 576)
        assert torch.equal(out[40 - start:60 - start], alone), (start, length)
    torch.testing.assert_close(alone, x[40:60] @ w.t() + bias, rtol=1e-4, atol=1e-3)  # the same product


@pytest.mark.parametrize("rows", [1, DENSE_ROW_BUCKET, DENSE_ROW_BUCKET + 1, 3 * DENSE_ROW_BUCKET])
def test_tiles_return_exactly_the_rows_asked_for(rows: int) -> None:
    w, x = torch.randn(8, 32), torch.randn(rows, 32)
    torch.testing.assert_close(tiled_matmul(x, w), x @ w.t(), rtol=1e-5, atol=1e-5)
    assert tiled_matmul(x, w).shape == (rows, 8)
