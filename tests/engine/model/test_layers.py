"""engine/model/layers.py's helpers: the row bucket and fixed-shape tiles deterministic steps rely on, the rope tables."""
from __future__ import annotations

import pytest
import torch

from engine.config import RopeConfig
from engine.model.layers import DENSE_ROW_BUCKET, rope_inv_freq, rope_lookup, rope_table, tiled_matmul


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_rows_of_a_table_are_the_rotation_of_their_positions(dtype: torch.dtype) -> None:
    """Rows looked up in a table of every position = cos / signed sin of those positions rounded once to `dtype`
    (the float32 angles' cos and sin are taken once, so the check does not rest on two calls of torch's cos)."""
    inv = rope_inv_freq(RopeConfig(theta=10000.0, scaling=None), 64)
    every = torch.arange(300)
    angles = every.float().unsqueeze(-1) * inv
    cos32, sin32 = angles.cos(), angles.sin()
    want_cos = torch.cat((cos32, cos32), -1).to(dtype).unsqueeze(-2)
    want_sin = torch.cat((-sin32, sin32), -1).to(dtype).unsqueeze(-2)
    table = rope_table(inv, every, dtype)
    assert table[0].shape == (300, 32) and table[0].dtype == dtype
    for positions in (torch.tensor([0]), torch.tensor([299, 5, 5, 17]), torch.arange(40, 140)):
        cos, sin = rope_lookup(*table, positions)
        assert torch.equal(cos, want_cos[positions]) and torch.equal(sin, want_sin[positions])
