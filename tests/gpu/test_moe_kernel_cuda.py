"""engine/kernels/moe.py on CUDA (skipped without one; run on the GPU machine): the fused experts against
`moe_reference` in bfloat16 at Qwen3-30B-A3B's expert shapes (E=128, k=8, H=2048, I=768) for 1 to 256 tokens,
gpt-oss-20b's MXFP4 experts (E=32, k=4, H=2880, I=2880, biases, clamped SwiGLU) against the reference on the
specification's dequantization, int4 experts; and the call captured once in a CUDA graph, replayed with new
inputs and routings (all tokens to one expert among them) in the same buffers, equal to eager calls.

`python3 bench/moe_kernel.py` times it.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

from engine.kernels import moe
from tests.support import moe_cases

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]
CUDA = "cuda"
BF16 = torch.bfloat16
QWEN = dict(experts=128, k=8, hidden=2048, inter=768)
GPT_OSS = dict(experts=32, k=4, hidden=2880, inter=2880)
# max |kernel - reference| / max |reference|: both round to bfloat16 at different points (the reference also rounds
# the gate_up product and each expert's output), a few ulps of the output's largest value
TOLERANCE = 1.5e-2


def _problem(n: int, experts: int, k: int, hidden: int, inter: int, fmt: str = "dense", bias: bool = False,
             seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    ids, weights = moe_cases.routing(n, experts, k, gen, CUDA)
    if fmt == "mxfp4":
        gate_up = moe_cases.mxfp4_stack(experts, 2 * inter, hidden, gen, CUDA)
        down = moe_cases.mxfp4_stack(experts, hidden, inter, gen, CUDA)
    elif fmt == "int4":
        gate_up = moe_cases.int4_stack(experts, 2 * inter, hidden, gen, CUDA)
        down = moe_cases.int4_stack(experts, hidden, inter, gen, CUDA)
    else:
        gate_up = moe_cases.dense_stack(experts, 2 * inter, hidden, gen, BF16, CUDA)
        down = moe_cases.dense_stack(experts, hidden, inter, gen, BF16, CUDA)
    return {"x": torch.randn(n, hidden, generator=gen).to(CUDA, BF16), "topk_ids": ids, "topk_weights": weights,
            "gate_up": gate_up, "down": down,
            "gate_up_bias": (torch.randn(experts, 2 * inter, generator=gen) * 0.3).to(CUDA, BF16) if bias else None,
            "down_bias": (torch.randn(experts, hidden, generator=gen) * 0.3).to(CUDA, BF16) if bias else None}


def _reference(args: dict, **activation) -> torch.Tensor:
    """moe_reference with quantized stacks dequantized from the specification (to bfloat16, as the kernels do)."""
    dense = {name: w if isinstance(w, torch.Tensor) else moe_cases.dequantized(w).to(BF16)
             for name, w in (("gate_up", args["gate_up"]), ("down", args["down"]))}
    return moe.moe_reference(**{**args, **dense}, **activation)


@pytest.mark.parametrize("n", [1, 8, 64, 256])
def test_qwen3_moe_shapes_match_the_reference(n):
    args = _problem(n, **QWEN)
    result = moe.fused_experts(**args)
    assert result.shape == (n, QWEN["hidden"]) and result.dtype == BF16
    error = moe_cases.max_error(result, moe.moe_reference(**args))
    assert error <= TOLERANCE, f"relative error {error:.2e}"


@pytest.mark.parametrize("n", [1, 64])
def test_gpt_oss_mxfp4_experts_match_the_dequantized_reference(n):
    args = _problem(n, **GPT_OSS, fmt="mxfp4", bias=True)
    activation = dict(activation="swiglu_clamp", alpha=1.702, limit=7.0)
    error = moe_cases.max_error(moe.fused_experts(**args, **activation), _reference(args, **activation))
    assert error <= TOLERANCE, f"relative error {error:.2e}"


def test_int4_experts_match_the_dequantized_reference():
    args = _problem(8, **QWEN, fmt="int4")
    error = moe_cases.max_error(moe.fused_experts(**args), _reference(args))
    assert error <= TOLERANCE, f"relative error {error:.2e}"


def test_a_prefill_chunk_of_many_pairs_matches_the_reference():
    """2,048 tokens: blocks of 64 slots and the two-launch alignment."""
    args = _problem(2048, **QWEN, seed=3)
    error = moe_cases.max_error(moe.fused_experts(**args), moe.moe_reference(**args))
    assert error <= TOLERANCE, f"relative error {error:.2e}"


@pytest.mark.parametrize("n", [1, 64])
def test_replays_from_a_cuda_graph_with_new_inputs_and_routings(n):
    args = _problem(n, **QWEN)
    x, ids, weights = args["x"], args["topk_ids"], args["topk_weights"]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        moe.fused_experts(**args)  # compiled before capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe.fused_experts(**args)
    gen = torch.Generator().manual_seed(n + 1)
    one_expert = torch.full_like(ids, 17)
    one_expert[:, 1:] = torch.arange(1, QWEN["k"], device=CUDA) + 100  # every token: expert 17 first
    for new_ids, new_weights in (moe_cases.routing(n, QWEN["experts"], QWEN["k"], gen, CUDA),
                                 (one_expert, weights.flip(-1).contiguous())):
        x.copy_(torch.randn(x.shape, generator=gen).to(CUDA, BF16))
        ids.copy_(new_ids)
        weights.copy_(new_weights)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, moe.fused_experts(**args))
        assert moe_cases.max_error(captured, moe.moe_reference(**args)) <= TOLERANCE
