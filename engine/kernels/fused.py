"""Fused kernels for the elementwise work between a decoder layer's matmuls (GPU, Triton), one call everywhere.

A decode step at small batch is launch-bound: Llama-3.2-1B at batch 1 spends most of a step in some 20 small
kernels per layer (bench/RESULTS.md#issue-13-gpu-fused-kernels). These calls merge them:

* `add_rms_norm`: the residual add and the next RMS norm (llama's `x = x + attn(...)` then
  `post_attention_layernorm(x)`, and the next layer's `input_layernorm` after `x + mlp(...)`); `rms_norm` alone
  (a stack's first norm). `norm_add_rms_norm`: gemma3's sandwich, the post-norm of the branch, the residual add
  and the next pre-norm in one.
* `rope_and_write_kv`: optional q/k RMS norms (qwen3, gemma3), rotary embedding of the q and k heads, and the
  store of k and v into the cache slots: replaces norm + cat, mul + roll + addcmul, and two index_copy_.
* `gated_activation`: chunk + silu/gelu + mul of the [gate | up] projection.

Each runs the Triton kernel of `engine.kernels.fused_triton` on CUDA tensors (and on CPU ones under
TRITON_INTERPRET=1, for the tests), the compiled CPU kernel of engine/kernels/csrc/cpu_kernels.cpp on other CPU tensors
(engine.kernels.cpu; TorchScript calls it too, so the scripted CPU stack gets it), and otherwise
`engine.kernels.fused_torch`: the same maths in plain torch ops (`torch.jit.is_scripting()` compiles the Triton
branch out of the scripted stack).
The kernels compute in float32 and round where the torch ops round, so results differ from the torch path only by
reduction order or libm (an ulp of the dtype here and there); residual sums, cached values and, in 16-bit dtypes,
rope without q/k norms match bit for bit.

Launch layout: one program per token row (norms, rope) or per (row, 1024 columns) (activation), its rows moved in
vectors of up to 16 bytes. A row's result never depends on the other rows (batch-invariant). No host
synchronisation and no allocation but the outputs: all are capturable in CUDA graphs. Slots may be int32 or int64.
"""
# No `from __future__ import annotations`: TorchScript compiles the public calls as part of the decoder stack.
import os
from typing import Optional, Tuple

import torch
from torch import Tensor

from engine.kernels import cpu as cpu_kernels, fused_torch as fused_kernels_torch, switches

try:
    from engine.kernels import fused_triton as _kernels
except ModuleNotFoundError as e:  # no triton in this environment: the torch path serves every call
    if e.name != "triton":
        raise
    _kernels = None

MAX_NORM_HIDDEN = 16384  # a norm row is held whole by one program; wider rows take the torch path
ACTIVATION_BLOCK = 1024


# On CPU the compiled kernels of engine/kernels/csrc/cpu_kernels.cpp; without them the torch ops serve. TorchScript takes
# no global values, so the scripted stack asks a function, which it inlines to a constant.
CPU_KERNELS = cpu_kernels.available()
if CPU_KERNELS:
    def cpu_kernels_on() -> bool:
        return True
else:
    def cpu_kernels_on() -> bool:
        return False


def triton_available() -> bool:
    """Whether the Triton kernels were imported."""
    return _kernels is not None


# EMBERSERVE_FUSED_KERNELS=0 (KernelSwitches.fused_kernels) keeps every call on the torch path (to measure what the
# kernels bring).


def _runs_triton(t: Tensor) -> bool:
    return _kernels is not None and switches.SWITCHES.fused_kernels and (
        t.is_cuda or (t.is_cpu and os.environ.get("TRITON_INTERPRET", "0") == "1"))


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _warps(elements: int, most: int) -> int:
    """Warps for a tile of `elements`: 8 a thread (one 16-byte vector of a 16-bit dtype), 1 to `most`."""
    return max(1, min(most, elements // 256))


def _rows(x: Tensor) -> Tensor:
    """x [..., d] as [rows, d] with unit column stride."""
    flat = x.reshape(-1, x.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def norm_config(hidden: int, has_residual: bool, norm_branch: bool) -> Tuple[dict, int]:
    """The norm kernel's constexprs and warps (sm_90, bf16: no spills up to 16384, tests/engine/...triton.py)."""
    block = _next_pow2(hidden)
    return dict(HIDDEN=hidden, BLOCK=block, HAS_RESIDUAL=has_residual, NORM_BRANCH=norm_branch), _warps(block, 16)


@torch.jit.ignore
def _launch_norm(x: Tensor, residual: Optional[Tensor], branch_weight: Optional[Tensor], weight: Tensor,
                 eps: float) -> Tuple[Tensor, Tensor]:
    hidden = x.shape[-1]
    for name, w in (("weight", weight), ("branch_weight", branch_weight)):
        if w is not None and w.numel() != hidden:
            raise ValueError(f"{name} has {w.numel()} elements for rows of {hidden}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                 or residual.device != x.device):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not match x {tuple(x.shape)} "
                         f"{x.dtype}")
    rows = _rows(x)
    normed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    summed = x if residual is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0] == 0:
        return normed, summed
    res = rows if residual is None else _rows(residual)
    constexprs, warps = norm_config(hidden, residual is not None, branch_weight is not None)
    _kernels.add_rms_norm_kernel[(rows.shape[0],)](
        rows, res, weight if branch_weight is None else branch_weight.contiguous(), weight.contiguous(),
        normed, summed, rows.stride(0), res.stride(0), eps, num_warps=warps, **constexprs)
    return normed, summed


def _cpu_weight(weight: Tensor, doubled: Optional[Tensor]) -> Tensor:
    """A norm's weight for the CPU kernels: the float32 table RMSNorm keeps ([weight, 0]: its first half) if there
    is one, else the weight itself."""
    return doubled if doubled is not None else weight


def rms_norm(x: Tensor, weight: Tensor, eps: float, doubled: Optional[Tensor] = None) -> Tensor:
    """RMS norm of x [..., hidden] times `weight` [hidden], float32 inside, in x's dtype; `doubled`: the
    RMSNorm's [weight, 0] float32 table, for the bfloat16 CPU path (fused_kernels_torch.rms_norm)."""
    if not torch.jit.is_scripting():
        if _runs_triton(x) and x.shape[-1] <= MAX_NORM_HIDDEN:
            return _launch_norm(x, None, None, weight, eps)[0]
    if cpu_kernels_on() and x.is_cpu:
        return torch.ops.emberserve.add_rms_norm(x, None, _cpu_weight(weight, doubled), eps)[0]
    return fused_kernels_torch.rms_norm(x, weight, eps, doubled)


def add_rms_norm(x: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float,
                 doubled: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """(rms_norm(summed), summed) with summed = x + residual in x's dtype, as `x = x + attn_out` adds; with
    residual None (a stack's first layer) summed is x itself. One kernel."""
    if not torch.jit.is_scripting():
        if _runs_triton(x) and x.shape[-1] <= MAX_NORM_HIDDEN:
            return _launch_norm(x, residual, None, weight, eps)
    if cpu_kernels_on() and x.is_cpu:
        return torch.ops.emberserve.add_rms_norm(x, residual, _cpu_weight(weight, doubled), eps)
    return fused_kernels_torch.add_rms_norm(x, residual, weight, eps, doubled)


def norm_add_rms_norm(branch: Tensor, residual: Tensor, branch_weight: Tensor, weight: Tensor, eps: float,
                      branch_doubled: Optional[Tensor] = None,
                      doubled: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """gemma3's sandwich norms in one kernel: summed = residual + rms_norm(branch, branch_weight) (the post-norm
    of attention or MLP, rounded to the dtype, then the add), → (rms_norm(summed, weight), summed)."""
    if not torch.jit.is_scripting():
        if _runs_triton(branch) and branch.shape[-1] <= MAX_NORM_HIDDEN:
            return _launch_norm(branch, residual, branch_weight, weight, eps)
    if cpu_kernels_on() and branch.is_cpu:
        return torch.ops.emberserve.norm_add_rms_norm(branch, residual, _cpu_weight(branch_weight, branch_doubled),
                                                      _cpu_weight(weight, doubled), eps)
    return fused_kernels_torch.norm_add_rms_norm(branch, residual, branch_weight, weight, eps, branch_doubled,
                                                 doubled)


def rope_config(heads: int, kv_heads: int, head_dim: int, qk_norm: bool, k_out: bool = False) -> Tuple[dict, int]:
    """The rope kernel's constexprs and warps."""
    qk_pad = _next_pow2(heads + kv_heads)
    return (dict(HEADS=heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim, QK_PAD=qk_pad, KV_PAD=_next_pow2(kv_heads),
                 HALF_PAD=_next_pow2(head_dim // 2), D_PAD=_next_pow2(head_dim), QK_NORM=qk_norm,
                 K_OUT=k_out),
            _warps(qk_pad * _next_pow2(head_dim), 8))


@torch.jit.ignore
def _launch_rope(qk: Tensor, v: Tensor, cos: Tensor, sin: Tensor, keys: Tensor, values: Tensor, slots: Tensor,
                 q_norm_weight: Optional[Tensor], k_norm_weight: Optional[Tensor], eps: float,
                 k_out: Optional[Tensor]) -> Tensor:
    if qk.dim() != 3 or keys.dim() != 3 or keys.shape != values.shape:
        raise ValueError(f"qk must be [N, H + KVH, D] and keys/values [KVH, slots, D] alike, got {tuple(qk.shape)}, "
                         f"{tuple(keys.shape)} and {tuple(values.shape)}")
    n, total, d = qk.shape
    kvh = keys.shape[0]
    heads = total - kvh
    if heads < 1 or d % 2 or keys.shape[2] != d or v.shape != (n, kvh, d):
        raise ValueError(f"qk {tuple(qk.shape)} and v {tuple(v.shape)} do not fit the cache's {kvh} KV heads of dim "
                         f"{keys.shape[2]} (head_dim even)")
    if cos.shape != (n, 1, d) or sin.shape != (n, 1, d):
        raise ValueError(f"cos and sin must be [{n}, 1, {d}], got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if slots.shape != (n,) or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slots must be int32 or int64 [{n}], got {slots.dtype} {tuple(slots.shape)}")
    if not qk.dtype == v.dtype == keys.dtype == values.dtype:
        raise ValueError(f"qk, v, keys and values must share a dtype, got {qk.dtype}, {v.dtype}, {keys.dtype}, "
                         f"{values.dtype}")
    for name, t in (("qk", qk), ("v", v), ("cos", cos), ("sin", sin), ("keys", keys), ("values", values)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous along head_dim")
    if k_out is not None and (k_out.shape != (n, kvh, d) or k_out.dtype != qk.dtype or not k_out.is_contiguous()):
        raise ValueError(f"k_out must be a contiguous {qk.dtype} [{n}, {kvh}, {d}], got {k_out.dtype} "
                         f"{tuple(k_out.shape)}")
    qk_norm = q_norm_weight is not None
    if qk_norm and (q_norm_weight.numel() != d or k_norm_weight.numel() != d):
        raise ValueError(f"q/k norm weights must have head_dim = {d} elements")
    q_out = torch.empty((n, heads, d), dtype=qk.dtype, device=qk.device)
    if n == 0:
        return q_out
    constexprs, warps = rope_config(heads, kvh, d, qk_norm, k_out is not None)
    q_w = q_norm_weight.contiguous() if qk_norm else cos
    k_w = k_norm_weight.contiguous() if qk_norm else cos
    _kernels.rope_write_kv_kernel[(n,)](
        qk, v, cos, sin, keys, values, slots.contiguous(), q_out, q_out if k_out is None else k_out, q_w, k_w,
        qk.stride(0), qk.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0),
        keys.stride(0), keys.stride(1), values.stride(0), values.stride(1), eps, num_warps=warps, **constexprs)
    return q_out


def rope_and_write_kv(qk: Tensor, v: Tensor, cos: Tensor, sin: Tensor, keys: Tensor, values: Tensor, slots: Tensor,
                      q_norm_weight: Optional[Tensor] = None, k_norm_weight: Optional[Tensor] = None,
                      eps: float = 1e-6, q_norm_doubled: Optional[Tensor] = None,
                      k_norm_doubled: Optional[Tensor] = None, k_out: Optional[Tensor] = None) -> Tensor:
    """The q and k heads qk [N, H + KVH, D] (the qkv projection's view) rotated by the sign-folded cos / sin
    [N, 1, D] (layers.apply_rope), after a per-head RMS norm when q_norm_weight and k_norm_weight [D] are given
    (eps; the *_doubled tables for the bfloat16 CPU path); the rotated k and v [N, KVH, D] written to `slots` [N]
    of keys / values [KVH, slots, D], and to `k_out` [N, KVH, D] if given (a fresh prefill attends over its own
    keys, layers.attend); → rotated q [N, H, D]. One kernel."""
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("q_norm_weight and k_norm_weight go together")
    if not torch.jit.is_scripting():
        if _runs_triton(qk):
            return _launch_rope(qk, v, cos, sin, keys, values, slots, q_norm_weight, k_norm_weight, eps, k_out)
    if cpu_kernels_on() and qk.is_cpu:
        qw: Optional[Tensor] = None
        kw: Optional[Tensor] = None
        if q_norm_weight is not None and k_norm_weight is not None:
            qw, kw = _cpu_weight(q_norm_weight, q_norm_doubled), _cpu_weight(k_norm_weight, k_norm_doubled)
        return torch.ops.emberserve.rope_write_kv(qk, v, cos, sin, keys, values, slots, qw, kw, eps, k_out)
    return fused_kernels_torch.rope_and_write_kv(qk, v, cos, sin, keys, values, slots, q_norm_weight,
                                                 k_norm_weight, eps, q_norm_doubled, k_norm_doubled, k_out)


def activation_config(features: int, gelu: bool, libdevice: bool = True) -> Tuple[dict, int]:
    """The activation kernel's constexprs and warps; `libdevice`: CUDA's expf / tanhf (not in the interpreter)."""
    block = min(ACTIVATION_BLOCK, _next_pow2(features))
    return dict(FEATURES=features, BLOCK=block, GELU=gelu, LIBDEVICE=libdevice), _warps(block, 4)


@torch.jit.ignore
def _launch_activation(gate_up: Tensor, gelu: bool) -> Tensor:
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up's last dimension ({gate_up.shape[-1]}) must be [gate | up], even")
    features = gate_up.shape[-1] // 2
    rows = _rows(gate_up)
    out = torch.empty(gate_up.shape[:-1] + (features,), dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0] == 0 or features == 0:
        return out
    constexprs, warps = activation_config(features, gelu, libdevice=gate_up.is_cuda)
    grid = (rows.shape[0], -(-features // constexprs["BLOCK"]))
    _kernels.gated_activation_kernel[grid](rows, out, rows.stride(0), features, num_warps=warps, **constexprs)
    return out


def gated_activation(gate_up: Tensor, gelu: bool) -> Tensor:
    """act(gate) * up of the concatenated [gate | up] projection [..., 2F] → [..., F]: SwiGLU, or GeGLU with tanh
    GELU (`gelu`). One kernel."""
    if not torch.jit.is_scripting():
        if _runs_triton(gate_up):
            return _launch_activation(gate_up, gelu)
    if cpu_kernels_on() and gate_up.is_cpu:
        return torch.ops.emberserve.gated_activation(gate_up, gelu)
    return fused_kernels_torch.gated_activation(gate_up, gelu)
