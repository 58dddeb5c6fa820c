"""engine/kernels/fused_triton.py compiled for the H200 (sm_90) here, without a GPU: at the shapes of the models we
serve and the launch parameters `engine.kernels.fused` picks, no kernel spills registers to local memory and the
rows move in 16-byte vectors. Triton ships ptxas and cuobjdump, so only triton is needed.

The arguments are declared as the JIT specialises them at launch: pointers and row strides 16-divisible (torch
allocations, hidden sizes and head dims multiples of 8 bfloat16s).
"""
from __future__ import annotations

import importlib.util

import pytest

from engine.kernels import fused as fused_kernels
from tests.support.sm90_compile import compile_sm90
from tests.support.fused_kernel_cases import MODELS

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


FLOAT32_POINTERS = ("weight_ptr", "branch_weight_ptr", "q_norm_ptr", "k_norm_ptr")  # the loader keeps norms float32


def _compile(kernel, constexprs: dict, warps: int, int_pointers: tuple[str, ...] = ()) -> tuple[str, int, int]:
    """The kernel compiled for sm_90 with bf16 tensors and float32 norm weights: (its PTX, registers, stack bytes
    per thread)."""

    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = ("*i64" if name in int_pointers else "*fp32" if name in FLOAT32_POINTERS
                               else "*bf16")
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name.startswith("stride_"):
            signature[name] = "i32"
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32"  # eps
    compiled, registers, stack = compile_sm90(kernel, signature, constexprs, attrs, warps)
    return compiled.asm["ptx"], registers, stack


# (hidden, residual, sandwich): llama's and gemma3's fused norms at their sizes, and the widest rows taken
NORMS = [(2048, True, False), (576, True, False), (1152, True, True), (8192, True, True), (16384, True, True),
         (1024, False, False)]


@pytest.mark.parametrize("hidden,residual,sandwich", NORMS, ids=[f"h{h}-{'sandwich' if s else 'add' if r else 'plain'}"
                                                                  for h, r, s in NORMS])
def test_norm_kernel_fits_sm90(hidden, residual, sandwich, tmp_path, monkeypatch):
    from engine.kernels import fused_triton as kernels

    monkeypatch.chdir(tmp_path)
    constexprs, warps = fused_kernels.norm_config(hidden, residual, sandwich)
    ptx, regs, stack = _compile(kernels.add_rms_norm_kernel, constexprs, warps)
    assert stack == 0, f"{regs} registers and {stack} bytes of stack a thread: spilling"
    assert "ld.global.v4.b32" in ptx, "rows are not loaded in 16-byte vectors"


@pytest.mark.parametrize("model,k_out", [(model, False) for model in MODELS] + [("gemma3-1b", True)])
def test_rope_kernel_fits_sm90(model, k_out, tmp_path, monkeypatch):
    from engine.kernels import fused_triton as kernels

    monkeypatch.chdir(tmp_path)
    s = MODELS[model]
    constexprs, warps = fused_kernels.rope_config(s.heads, s.kv_heads, s.head_dim, s.qk_norm, k_out)
    ptx, regs, stack = _compile(kernels.rope_write_kv_kernel, constexprs, warps, int_pointers=("slots_ptr",))
    assert stack == 0, f"{regs} registers and {stack} bytes of stack a thread: spilling"


@pytest.mark.parametrize("model", list(MODELS))
def test_activation_kernel_fits_sm90(model, tmp_path, monkeypatch):
    from engine.kernels import fused_triton as kernels

    monkeypatch.chdir(tmp_path)
    s = MODELS[model]
    constexprs, warps = fused_kernels.activation_config(s.ffn, s.gelu)
    ptx, regs, stack = _compile(kernels.gated_activation_kernel, constexprs, warps)
    assert stack == 0, f"{regs} registers and {stack} bytes of stack a thread: spilling"
    assert "ld.global.v4.b32" in ptx, "rows are not loaded in 16-byte vectors"
