"""engine/kernels/fused.py's Triton kernels compiled for a real GPU against the torch path (the ops the blocks run
today) at every served model's shapes and 1, 3, 8 and 128 rows; CUDA-graph capture; int64 cache offsets; and a
timing print (not an assertion) of each fused kernel against the torch ops it replaces, both replayed from CUDA
graphs.

Skipped without CUDA or Triton. `pytest -s tests/gpu/test_fused_kernels_cuda.py` shows the timings.
"""
from __future__ import annotations

import dataclasses
import importlib.util
from typing import Callable

import pytest
import torch

from engine.kernels import fused as fused_kernels, fused_torch as fused_kernels_torch
from tests.support.fused_kernel_cases import MODELS, VARIANTS, Case, build, check, copied, expected, model_cases

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]
CASES = model_cases((1, 3, 8, 128)) + VARIANTS


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matches_torch(case):
    assert fused_kernels.triton_available()
    args = build(case, "cuda")
    mine = copied(args)
    check(case, args, getattr(fused_kernels, case.call)(**mine), mine)


def test_calls_in_a_cuda_graph():
    """Captured once, replayed with new inputs (slots and rope tables included) in the same buffers."""
    cases = [Case("add_rms_norm", "llama-1b", 8), Case("norm_add_rms_norm", "gemma3-1b", 8),
             Case("rope_and_write_kv", "qwen3-0.6b", 8, variant="int32-slots"),
             Case("rope_and_write_kv", "llama-1b", 8), Case("gated_activation", "gemma3-1b", 8)]
    static = [build(case, "cuda") for case in cases]

    def step() -> list:
        return [getattr(fused_kernels, case.call)(**args) for case, args in zip(cases, static)]

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for seed in (1, 2):
        fresh = [build(dataclasses.replace(case, seed=seed), "cuda") for case in cases]
        for args, new in zip(static, fresh):
            for name, value in new.items():
                if isinstance(value, torch.Tensor):
                    args[name].copy_(value)  # q / k / v views write through into the static projection
        graph.replay()
        torch.cuda.synchronize()
        for case, args, new, out in zip(cases, static, fresh, outs):
            check(case, new, out, args)


def test_cache_offsets_past_int32():
    """A pool of more than 2**31 elements per layer (what a large GPU's KV budget gives), written at its far end."""
    s = MODELS["llama-1b"]
    case = Case("rope_and_write_kv", "llama-1b", 3)
    small = build(case, "cuda")
    pool = 2**31 // (s.kv_heads * s.head_dim) + 64
    far = torch.tensor([pool - 1, pool - 100, 5], device="cuda")
    big = dict(small, keys=torch.zeros((s.kv_heads, pool, s.head_dim), dtype=torch.bfloat16, device="cuda"),
               values=torch.zeros((s.kv_heads, pool, s.head_dim), dtype=torch.bfloat16, device="cuda"), slots=far)
    q = fused_kernels.rope_and_write_kv(**big)
    want_q, want = expected(case, small)
    at = small["slots"]
    # bit for bit (bf16 rope without q/k norms: see fused_kernel_cases)
    assert torch.equal(q, want_q)
    assert torch.equal(big["keys"][:, far], want["keys"][:, at])
    assert torch.equal(big["values"][:, far], want["values"][:, at])
    del big
    torch.cuda.empty_cache()


def _time_us(fn: Callable[[], object], repeats: int = 200) -> float:
    """GPU time of one call of `fn`, replayed from a CUDA graph (as decode steps run: no launch overhead)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1000 * start.elapsed_time(end) / repeats


def _kernels_launched(fn: Callable[[], object]) -> str:
    """How many GPU kernels (and copies) one eager call runs, from the profiler."""
    try:
        from torch.profiler import ProfilerActivity, profile

        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return str(sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA))
    except Exception:  # noqa: BLE001 - a print only: no profiler, no count
        return "?"


# What a decoder layer runs through these calls: llama 2 add + norms, rope, activation; gemma3 2 sandwiches.
TIMED = [("llama-1b", "add_rms_norm"), ("llama-1b", "rope_and_write_kv"), ("llama-1b", "gated_activation"),
         ("qwen3-0.6b", "rope_and_write_kv"), ("gemma3-1b", "norm_add_rms_norm"), ("gemma3-1b", "rope_and_write_kv"),
         ("gemma3-1b", "gated_activation")]
PER_LAYER = {"llama-1b": {"add_rms_norm": 2, "rope_and_write_kv": 1, "gated_activation": 1},
             "gemma3-1b": {"norm_add_rms_norm": 2, "rope_and_write_kv": 1, "gated_activation": 1}}


def test_timing_print(capsys):
    lines = ["fused kernels vs the torch ops they replace, replayed from CUDA graphs (bf16):",
             "| model | call | rows | fused us | torch us | torch kernels |", "|---|---|---|---|---|---|"]
    per_layer: dict[tuple[str, int], list[float]] = {}
    for rows in (1, 128):
        for model, call in TIMED:
            args = build(Case(call, model, rows), "cuda")
            fused_us = _time_us(lambda: getattr(fused_kernels, call)(**args))
            torch_us = _time_us(lambda: getattr(fused_kernels_torch, call)(**args))
            launches = _kernels_launched(lambda: getattr(fused_kernels_torch, call)(**args))
            lines.append(f"| {model} | {call} | {rows} | {fused_us:.1f} | {torch_us:.1f} | {launches} |")
            times = per_layer.setdefault((model, rows), [0.0, 0.0])
            count = PER_LAYER.get(model, {}).get(call, 0)
            times[0] += count * fused_us
            times[1] += count * torch_us
    for (model, rows), (fused_us, torch_us) in per_layer.items():
        if model in PER_LAYER:
            lines.append(f"{model}, {rows} rows, per layer (norms, rope + KV write, activation): fused "
                         f"{fused_us:.1f} us, torch {torch_us:.1f} us")
    with capsys.disabled():
        print("\n" + "\n".join(lines))
