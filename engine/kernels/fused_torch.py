"""The maths of `engine.kernels.fused` in plain torch ops: exactly what the decoder blocks compute today, op for op.

The fallback of every fused call (CPU, TorchScript, no Triton) and the reference the kernels are tested against.
`rms_norm`, `apply_rope` and `gated_activation` are engine/model/layers.py's own definitions (moved here so that both
modules share one; layers.py imports this module, never the other way round).
"""
# No `from __future__ import annotations`: TorchScript compiles these as part of the decoder stack.
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.cache.kv_cache import write_slots


def rms_norm(x: Tensor, weight: Tensor, eps: float, doubled: Optional[Tensor] = None) -> Tensor:
    """RMS norm of x [..., d] times `weight`, computed in float32, in x's dtype.

    `doubled` ([weight, 0] in float32, `RMSNorm.doubled`) selects the bfloat16 CPU path: the RMS norm of x is the
    layer norm of [x, -x] (mean 0, variance mean(x^2)), and torch's fused CPU layer_norm (float32 inside,
    mixed-type weight) takes half the time of its rms_norm with the float32 round trip. Without it, or on other
    devices and for float32, the float32 rms_norm serves."""
    d = x.shape[-1]
    if doubled is None or x.dtype == torch.float32 or not x.is_cpu:
        return torch.rms_norm(x.float(), [d], weight.float(), eps).to(x.dtype)
    y = F.layer_norm(torch.cat((x, x.neg()), dim=-1), [2 * d], doubled, None, eps)
    return y[..., :d].contiguous()


def add_rms_norm(x: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float,
                 doubled: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """(rms_norm(x + residual), x + residual); with no residual (the first layer), (rms_norm(x), x)."""
    summed = x if residual is None else x + residual
    return rms_norm(summed, weight, eps, doubled), summed


def norm_add_rms_norm(branch: Tensor, residual: Tensor, branch_weight: Tensor, weight: Tensor, eps: float,
                      branch_doubled: Optional[Tensor] = None,
                      doubled: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """gemma3's sandwich: summed = residual + rms_norm(branch, branch_weight), then (rms_norm(summed, weight),
    summed)."""
    summed = residual + rms_norm(branch, branch_weight, eps, branch_doubled)
    return rms_norm(summed, weight, eps, doubled), summed


def apply_rope(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """Rotate x [N, H, D] by cos / signed sin [N, 1, D]: x * cos + rotate_half(x) * sin in three ops."""
    return torch.addcmul(x * cos, torch.roll(x, x.shape[-1] // 2, dims=-1), signed_sin)


def rope_and_write_kv(qk: Tensor, v: Tensor, cos: Tensor, sin: Tensor, keys: Tensor, values: Tensor, slots: Tensor,
                      q_norm_weight: Optional[Tensor] = None, k_norm_weight: Optional[Tensor] = None,
                      eps: float = 1e-6, q_norm_doubled: Optional[Tensor] = None,
                      k_norm_doubled: Optional[Tensor] = None, k_out: Optional[Tensor] = None) -> Tensor:
    """q and k heads qk [N, H + KVH, D] (RMS-normed per head first when both norm weights are given) rotated;
    the k heads and v [N, KVH, D] stored at `slots` [N] of keys / values [KVH, slots, D] (and the k heads to
    `k_out` if given); → the q heads [N, H, D]."""
    h = qk.shape[1] - keys.shape[0]
    if q_norm_weight is not None and k_norm_weight is not None:
        qk = torch.cat((rms_norm(qk[:, :h], q_norm_weight, eps, q_norm_doubled),
                        rms_norm(qk[:, h:], k_norm_weight, eps, k_norm_doubled)), dim=1)
    qk = apply_rope(qk, cos, sin)  # q and k heads rotated together
    write_slots(keys, values, slots.long(), qk[:, h:], v)
    if k_out is not None:
        k_out.copy_(qk[:, h:])
    return qk[:, :h]


def gated_activation(gate_up: Tensor, gelu: bool) -> Tensor:
    """act(gate) * up of the concatenated [gate, up] projection: SwiGLU, or GeGLU with tanh GELU."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)
    return gate * up
