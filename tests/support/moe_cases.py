"""Random mixture-of-experts problems for engine/kernels/moe.py, shared by tests/engine/kernels/test_moe.py (Triton's
interpreter) and tests/gpu/test_moe_kernel_cuda.py (CUDA): routings, dense / MXFP4 / int4 expert stacks, the
MXFP4 and int4 dequantization written from their specifications (not the engine's), and the comparison.
"""
from __future__ import annotations

import torch

from engine.kernels import moe

GROUP = 32


def routing(n: int, experts: int, k: int, gen: torch.Generator, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(ids int64 [n, k], weights float32 [n, k]): softmax then top-k of random router logits, renormalised."""
    logits = torch.randn(n, experts, generator=gen)
    weights, ids = torch.topk(logits.softmax(-1), k)
    return ids.to(device), (weights / weights.sum(-1, keepdim=True)).to(device)


def dense_stack(experts: int, out: int, inp: int, gen: torch.Generator, dtype: torch.dtype,
                device: str = "cpu") -> torch.Tensor:
    return (torch.randn(experts, out, inp, generator=gen) / inp ** 0.5).to(device=device, dtype=dtype)


def e2m1_value(code: torch.Tensor) -> torch.Tensor:
    """OCP MX E2M1: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0; exponent 0 is subnormal
    (2^0 x m/2), else 2^(e - 1) x (1 + m/2)."""
    code = code.long()
    sign = 1 - 2 * ((code >> 3) & 1)
    exponent = (code >> 1) & 3
    mantissa = (code & 1).double()
    magnitude = torch.where(exponent == 0, mantissa / 2, torch.exp2(exponent.double() - 1) * (1 + mantissa / 2))
    return sign * magnitude


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float64 [..., out, in] of MXFP4 blocks uint8 [..., out, in/2] (element 2j in the low nibble, 2j + 1 in the
    high) and E8M0 scales uint8 [..., out, in/32] (2^(s - 127))."""
    low, high = e2m1_value(blocks & 15), e2m1_value(blocks >> 4)
    values = torch.stack((low, high), dim=-1).flatten(-2)
    scale = torch.exp2(scales.double() - 127)
    return (values.unflatten(-1, (-1, GROUP)) * scale.unsqueeze(-1)).flatten(-2)


def mxfp4_stack(experts: int, out: int, inp: int, gen: torch.Generator, device: str = "cpu") -> moe.ExpertWeights:
    """Random codes; scales around 2^-3 .. 2^-1 over sqrt(in), as trained gpt-oss experts' magnitudes go."""
    blocks = torch.randint(0, 256, (experts, out, inp // 2), generator=gen, dtype=torch.uint8)
    shift = round(torch.log2(torch.tensor(inp ** 0.5)).item())
    scales = torch.randint(124 - shift, 127 - shift, (experts, out, inp // GROUP), generator=gen, dtype=torch.uint8)
    return moe.mxfp4(blocks.to(device), scales.to(device))


def int4_stack(experts: int, out: int, inp: int, gen: torch.Generator, device: str = "cpu") -> moe.ExpertWeights:
    codes = torch.randint(0, 16, (experts, out, inp), generator=gen, dtype=torch.uint8)
    scales = torch.rand(experts, out, inp // GROUP, generator=gen) / (4 * inp ** 0.5)
    offsets = -8 * scales * (1 + 0.1 * torch.randn(experts, out, inp // GROUP, generator=gen))
    return moe.int4(moe.pack_nibbles(codes).to(device), scales.to(device), offsets.to(device))


def dequantized(w: moe.ExpertWeights) -> torch.Tensor:
    """float64 [E, out, in] of an MXFP4 or int4 stack, from the specification (int4: code x scale + offset)."""
    if w.format == "mxfp4":
        return mxfp4_dequantize(w.data, w.scales)
    codes = torch.stack((w.data & 15, w.data >> 4), dim=-1).flatten(-2).double()
    return (codes.unflatten(-1, (-1, GROUP)) * w.scales.double().unsqueeze(-1)
            + w.offsets.double().unsqueeze(-1)).flatten(-2)


def formula(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
            gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
            activation: str = "silu", alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """The MoE output token by token in float64, from the definition (HF's Qwen3-MoE / gpt-oss experts): ids
    outside [0, E) skipped."""
    ids, weights = topk_ids, topk_weights
    x, gate_up, down = x.double(), gate_up.double(), down.double()
    inter = gate_up.shape[1] // 2
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if not 0 <= e < gate_up.shape[0]:
                continue
            h = gate_up[e] @ x[t] + (0 if gate_up_bias is None else gate_up_bias[e].double())
            gate, up = h[:inter], h[inter:]
            if activation == "swiglu_clamp":
                gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
                act = (up + 1) * gate * torch.sigmoid(gate * alpha)
            else:
                act = torch.nn.functional.silu(gate) * up
            y = down[e] @ act + (0 if down_bias is None else down_bias[e].double())
            out[t] += float(weights[t, j]) * y
    return out


def max_error(result: torch.Tensor, expected: torch.Tensor) -> float:
    """max |result - expected| relative to max |expected|."""
    return float((result.double() - expected.double()).abs().max() / expected.double().abs().max().clamp_min(1e-30))
