"""engine/kernels/moe_triton.py compiled for the H100 (sm_90) here, without a GPU: at Qwen3-30B-A3B's and gpt-oss-20b's
expert shapes and the tiles `engine.kernels.moe.moe_config` picks for decode and for a prefill chunk, no kernel
spills registers to local memory, the 64-feature tiles run on wgmma, and MXFP4 weights go through the inline PTX
conversion (ptxas checks it). Triton ships ptxas and cuobjdump, so only triton is needed.
"""
from __future__ import annotations

import importlib.util

import pytest

from tests.support.sm90_compile import compile_sm90

from engine.kernels import moe

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

# (experts, top_k, hidden, intermediate)
SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "gpt-oss-20b": (32, 4, 2880, 2880)}
_TYPES = {"slots_ptr": "*i32", "ends_ptr": "*i32", "ids_ptr": "*i64", "counts_ptr": "*i32", "ranks_ptr": "*i32",
          "weights_ptr": "*fp32", "parts_ptr": "*fp32", "alpha": "fp32", "limit": "fp32"}


def _compile(kernel, constexprs: dict, warps: int, stages: int, types: dict[str, str]) -> tuple[str, int, int]:
    """The kernel compiled for sm_90: (its PTX, registers, stack bytes per thread)."""
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        signature[name] = types.get(name, _TYPES.get(name, "i32"))
        if name.endswith("_ptr") or name.startswith("stride_"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    compiled, registers, stack = compile_sm90(kernel, signature, constexprs, attrs, warps, stages)
    return compiled.asm["ptx"], registers, stack


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@pytest.mark.parametrize("fmt", ["dense", "mxfp4"])
@pytest.mark.parametrize("tokens", [1, 2048])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_gemm_kernels_fit_sm90(shape, tokens, fmt, tmp_path, monkeypatch):
    from engine.kernels import moe_triton as kernels

    monkeypatch.chdir(tmp_path)
    experts, top_k, hidden, inter = SHAPES[shape]
    cfg = moe.moe_config(tokens * top_k, experts, hidden, inter, fmt != "dense")
    weights = "*u8" if fmt == "mxfp4" else "*bf16"
    types = {"x_ptr": "*bf16", "a_ptr": "*bf16", "w_ptr": weights, "ws_ptr": "*u8", "wo_ptr": "*u8",
             "bias_ptr": "*bf16"}
    common = dict(E=experts, E_PAD=_next_pow2(experts), BLOCK_M=cfg.block_m, FORMAT=moe.FORMATS.index(fmt),
                  HAS_BIAS=shape == "gpt-oss-20b", PRECISION="tf32", ASM=True)
    g, d = cfg.gate_up, cfg.down
    ptx, regs, stack = _compile(kernels.moe_gate_up_kernel,
                                dict(common, TOP_K=top_k, K=hidden, I=inter, BLOCK_N=g.block_n, BLOCK_K=g.block_k,
                                     ACTIVATION=int(shape == "gpt-oss-20b"), EVEN_K=hidden % g.block_k == 0),
                                g.warps, g.stages, {**types, "out_ptr": "*bf16"})
    assert stack == 0, f"gate_up: {regs} registers and {stack} bytes of stack a thread: spilling"
    assert (fmt == "mxfp4") == ("fma.rn.bf16x2" in ptx)
    if g.block_n >= 64:
        assert "wgmma" in ptx
    ptx, regs, stack = _compile(kernels.moe_down_kernel,
                                dict(common, K=inter, H=hidden, BLOCK_N=d.block_n, BLOCK_K=d.block_k,
                                     EVEN_K=inter % d.block_k == 0),
                                d.warps, d.stages, {**types, "out_ptr": "*fp32"})
    assert stack == 0, f"down: {regs} registers and {stack} bytes of stack a thread: spilling"
    if d.block_n >= 64:
        assert "wgmma" in ptx


@pytest.mark.parametrize("single", [True, False])
def test_alignment_and_sum_kernels_fit_sm90(single, tmp_path, monkeypatch):
    from engine.kernels import moe_triton as kernels

    monkeypatch.chdir(tmp_path)
    align = dict(E=128, E_PAD=128, CHUNK=64, CHUNK_ROWS=32, BLOCK_M=16 if single else 64, SINGLE=single)
    assert _compile(kernels.moe_align_kernel, align, 4, 1, {})[2] == 0
    assert _compile(kernels.moe_count_kernel, dict(E=128, E_PAD=128, CHUNK=64), 4, 1, {})[2] == 0
    assert _compile(kernels.moe_sum_kernel, dict(E=128, TOP_K=8, H=2048, BLOCK_H=1024), 4, 1,
                    {"out_ptr": "*bf16"})[2] == 0
