"""engine/kernels/paged_attention_triton.py compiled for the H200 (sm_90) here, without a GPU: at the shapes of the models
we serve and the launch parameters `engine.kernels.paged_attention` picks, no kernel spills registers to local memory and
the key loops are software-pipelined (cp.async). Triton ships ptxas and cuobjdump, so only triton is needed.

The integer arguments are declared as the JIT specialises them at launch: pointers and strides 16-divisible (torch
allocations, head_dim 64/128/256), the block table's width not necessarily.
"""
from __future__ import annotations

import importlib.util

import pytest

from tests.support.sm90_compile import compile_sm90
import torch

from engine.kernels import paged_attention

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

# (heads, kv heads, head_dim, window, attention sinks) of Llama-3.2-1B, Qwen3-0.6B, Gemma-3-1B, gpt-oss-20b's
# sliding layers
MODELS = {"llama-1b": (32, 8, 64, 0, False), "qwen3-0.6b": (16, 8, 128, 0, False), "gemma3-1b": (4, 1, 256, 512, False),
          "gpt-oss-20b": (64, 8, 64, 128, True)}
_INT_POINTERS = ("tables_ptr", "seq_lens_ptr", "query_lens_ptr", "query_starts_ptr")


def _compile(kernel, constexprs: dict, warps: int, dtype: str):
    """The kernel compiled for sm_90 with these constexprs: (compiled kernel, registers, stack bytes per thread)."""
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        if name.endswith("_ptr"):
            signature[name] = ("*i32" if name in _INT_POINTERS
                               else "*fp32" if name.startswith("part_") or name == "sinks_ptr" else f"*{dtype}")
        else:
            signature[name] = "fp32" if name == "qk_scale" else "i32"
        if name.endswith("_ptr") or (name.startswith("stride_") and name != "stride_tb"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return compile_sm90(kernel, signature, constexprs, attrs, warps)


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("segments", [1, 8])
def test_decode_kernel_fits_sm90(model, segments, tmp_path, monkeypatch):
    from engine.kernels import paged_attention_triton as kernels

    monkeypatch.chdir(tmp_path)
    heads, kv_heads, head_dim, window, sinks = MODELS[model]
    main, reduce = paged_attention.decode_config(heads, kv_heads, head_dim, 16, torch.bfloat16, segments, window > 0,
                                                 sinks)
    compiled, regs, stack = _compile(kernels.paged_decode_kernel, main, paged_attention.DECODE_WARPS, "bf16")
    assert stack == 0, f"{regs} registers and {stack} bytes of stack a thread: spilling"
    assert "cp.async" in compiled.asm["ptx"], "the key loop is not pipelined"
    if segments > 1:
        _, regs, stack = _compile(kernels.paged_decode_reduce_kernel, reduce, paged_attention.DECODE_WARPS, "bf16")
        assert stack == 0, f"reduction: {regs} registers and {stack} bytes of stack a thread"


@pytest.mark.parametrize("model", list(MODELS))
def test_prefill_kernel_fits_sm90(model, tmp_path, monkeypatch):
    from engine.kernels import paged_attention_triton as kernels

    monkeypatch.chdir(tmp_path)
    heads, kv_heads, head_dim, window, sinks = MODELS[model]
    constexprs, warps = paged_attention.prefill_config(heads, kv_heads, head_dim, 16, torch.bfloat16, window > 0,
                                                       sinks)
    compiled, regs, stack = _compile(kernels.paged_prefill_kernel, constexprs, warps, "bf16")
    assert stack == 0, f"{regs} registers and {stack} bytes of stack a thread: spilling"
    assert "cp.async" in compiled.asm["ptx"], "the key loop is not pipelined"
