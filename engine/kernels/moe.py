"""Mixture-of-experts feed-forward on a GPU: the routed experts of every token in a few Triton launches.

`fused_experts(x, ids, weights, gate_up, down, ...)` computes, for each token t,
    out[t] = sum_j weights[t, j] * (down[e] @ act(gate_up[e] @ x[t] + b1[e]) + b2[e]),  e = ids[t, j],
with gate_up's rows [gate (I rows); up (I rows)] and act "silu" (silu(gate) * up) or "swiglu_clamp" (gpt-oss's
clamped SwiGLU with its alpha and limit). Ids outside [0, E) (another rank's experts) contribute nothing.

On CUDA (and on CPU under TRITON_INTERPRET=1, for the tests) it runs as vLLM's and SGLang's fused MoE do:
1. alignment (`align`): the N x k (token, k) pairs sorted by expert into slots, each expert's run padded to a
   multiple of BLOCK_M, so that a block of rows has one expert and reads its weights once per output tile (at
   decode every routed expert's weights are read once per layer). One launch when the pairs fit a chunk, else two.
2. gate_up GEMM over the slots with the activation in its epilogue → [slots, I] in x's dtype.
3. down GEMM with the routing weight applied → float32 [N x k, H], each pair's row.
4. the sum over k, rounded once to x's dtype (in order of k: no atomics, so results are deterministic).
Every buffer is sized from N alone (at most N*k + min(E, N*k) * (BLOCK_M - 1) slots): no host synchronisation, no
shape that depends on the routing, so the whole call is capturable in a CUDA graph. The GEMMs compute their tiles
as [features, slots] with the weights on the left (wgmma from 64 features); products accumulate in float32.

Elsewhere `moe_reference` serves: a loop over experts in torch (the tests' reference; not capturable). Weights are
an `ExpertWeights` stack: dense float, MXFP4 (E2M1 codes in nibbles, an E8M0 scale a 32 inputs) or affine int4
(codes in nibbles, a float scale and offset a 32 inputs), dequantized in the kernels' registers (MXFP4 to bfloat16
by inline PTX on CUDA). Speed: bench/moe_kernel.py, bench/RESULTS.md#issue-36-gpu-moe-kernel. `fused_experts` is
not TorchScript: a scripted module calls it under `if not torch.jit.is_scripting()`, as engine/kernels/fused.py's
callers do.
"""
import os
from typing import NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

try:
    from engine.kernels import moe_triton as _kernels
except ModuleNotFoundError as e:  # no triton in this environment: the torch reference serves every call
    if e.name != "triton":
        raise
    _kernels = None

GROUP = 32  # inputs sharing one MXFP4 / int4 scale
FORMATS = ("dense", "mxfp4", "int4")
ACTIVATIONS = ("silu", "swiglu_clamp")


class ExpertWeights(NamedTuple):
    """A stack of E experts' [out, in] matrices in one format (build them with `dense`, `mxfp4`, `int4`).

    dense: data float [E, out, in]. mxfp4: data uint8 [E, out, in/2] (input 2j in the low nibble, 2j + 1 in the
    high), scales uint8 E8M0 [E, out, in/32] (2^(s - 127)). int4: data as mxfp4's with unsigned codes 0..15,
    w = code * scales + offsets, scales and offsets float [E, out, in/32]."""
    format: str
    data: Tensor
    scales: Optional[Tensor]
    offsets: Optional[Tensor]

    @property
    def shape(self) -> Tuple[int, int, int]:
        e, out, stored = self.data.shape
        return e, out, stored if self.format == "dense" else 2 * stored


def dense(w: Tensor) -> ExpertWeights:
    return ExpertWeights("dense", w, None, None)


def _groups_by_column(t: Tensor) -> Tensor:
    """[E, out, groups] with the outputs adjacent in memory (a [E, groups, out] tensor's view): the kernels load a
    tile's columns' scales of one group together."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def mxfp4(blocks: Tensor, scales: Tensor) -> ExpertWeights:
    """An MXFP4 stack, its scales in the kernels' layout (`_groups_by_column`: a copy unless they are already)."""
    return ExpertWeights("mxfp4", blocks, _groups_by_column(scales), None)


def int4(packed: Tensor, scales: Tensor, offsets: Tensor) -> ExpertWeights:
    """An affine int4 stack, its scales and offsets in the kernels' layout (`_groups_by_column`)."""
    return ExpertWeights("int4", packed, _groups_by_column(scales), _groups_by_column(offsets))


def pack_nibbles(codes: Tensor) -> Tensor:
    """uint8 codes 0..15 [..., in] → [..., in/2], input 2j in the low nibble (how `int4` takes Affine4Bit codes)."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _as_experts(w) -> ExpertWeights:
    return w if isinstance(w, ExpertWeights) else dense(w)


_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def expert_matrix(w: ExpertWeights, e: int, dtype: torch.dtype) -> Tensor:
    """Expert e's [out, in] matrix in `dtype` (dequantized in float32, then rounded, as the kernels do)."""
    if w.format == "dense":
        return w.data[e].to(dtype)
    q = w.data[e]
    codes = torch.stack((q & 15, q >> 4), dim=-1).flatten(-2).long()  # [out, in]
    scales = w.scales[e]
    if w.format == "mxfp4":
        values = torch.tensor(_E2M1, device=q.device)[codes]
        scale = torch.exp2(scales.float() - 127)
        return (values * scale.repeat_interleave(GROUP, dim=-1)).to(dtype)
    offsets = w.offsets[e].float().repeat_interleave(GROUP, dim=-1)
    return (codes.float() * scales.float().repeat_interleave(GROUP, dim=-1) + offsets).to(dtype)


def activate(gate: Tensor, up: Tensor, activation: str, alpha: float, limit: float) -> Tensor:
    """The experts' gated activation in float32."""
    if activation == "swiglu_clamp":
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
        return gate * torch.sigmoid(alpha * gate) * (up + 1)
    return F.silu(gate) * up


def moe_reference(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, gate_up, down,
                  gate_up_bias: Optional[Tensor] = None, down_bias: Optional[Tensor] = None,
                  activation: str = "silu", alpha: float = 1.702, limit: float = 7.0) -> Tensor:
    """`fused_experts` as a loop over experts in torch ops: each expert's tokens through its two projections in x's
    dtype, the activation in float32, the weighted sum in float32 rounded once."""
    gate_up, down = _as_experts(gate_up), _as_experts(down)
    n, k = topk_ids.shape
    inter = gate_up.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.reshape(-1)
    tokens = torch.arange(n, device=x.device).repeat_interleave(k)
    weights = topk_weights.reshape(-1).float()
    for e in range(gate_up.shape[0]):
        chosen = (flat_ids == e).nonzero().squeeze(1)
        if chosen.numel() == 0:
            continue
        rows = tokens[chosen]
        h = F.linear(x[rows], expert_matrix(gate_up, e, x.dtype),
                     None if gate_up_bias is None else gate_up_bias[e].to(x.dtype)).float()
        a = activate(h[:, :inter], h[:, inter:], activation, alpha, limit).to(x.dtype)
        y = F.linear(a, expert_matrix(down, e, x.dtype), None if down_bias is None else down_bias[e].to(x.dtype))
        out.index_add_(0, rows, y.float() * weights[chosen, None])
    return out.to(x.dtype)


# --- the Triton path --------------------------------------------------------------------------------------------

class GemmConfig(NamedTuple):
    block_n: int
    block_k: int
    warps: int
    stages: int


class MoeConfig(NamedTuple):
    """Tiles of one call: BLOCK_M slots a block (the alignment's padding), each GEMM's tile and pipeline."""
    block_m: int
    gate_up: GemmConfig
    down: GemmConfig
    align_chunk: int = 0  # pairs a program of the alignment counts (0: from the number of experts)


def moe_config(num_pairs: int, num_experts: int, hidden: int, inter: int, packed: bool) -> MoeConfig:
    """BLOCK_M from the pairs an expert gets on average (16 at decode: one block an expert). 64 features a tile (the
    narrowest that runs on wgmma) and 128 inputs, 4 warps: the fastest of bench/moe_kernel.py --sweep on an H100 at
    1 and 64 tokens for both GEMMs, bfloat16 and MXFP4 (bench/RESULTS.md#issue-36-gpu-moe-kernel). Dense tiles
    that do not divide the inputs take 64 (masks); 4-bit ones keep 128 (their loads are masked anyway)."""
    per_expert = num_pairs / num_experts
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64

    def block_k(inputs: int) -> int:
        return 128 if packed or inputs % 128 == 0 else 64

    if block_m == 16:
        return MoeConfig(16, GemmConfig(64, block_k(hidden), 4, 4), GemmConfig(64, block_k(inter), 4, 3))
    return MoeConfig(block_m, GemmConfig(64, block_k(hidden) if packed else 64, 4, 3),
                     GemmConfig(128, block_k(inter) if packed else 64, 8, 3))


def max_slots(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Slots the worst routing of `num_pairs` pairs needs: every routed expert's run padded by up to BLOCK_M - 1."""
    return num_pairs + min(num_experts, num_pairs) * (block_m - 1)


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def align(topk_ids: Tensor, num_experts: int, block_m: int, chunk: int = 0) -> Tuple[Tensor, Tensor]:
    """(slots int32 [max_slots]: the pair index t * k + j of each slot, the number of pairs on padding slots (slots
    past the last expert's end are unused); ends int32 [E]: each expert's padded end slot). Pairs keep their order
    within an expert. One launch when the pairs fit one chunk (`chunk` pairs, 0: as many as a [chunk, E] tile of
    8192 holds), else two."""
    num_pairs = topk_ids.numel()
    ids = topk_ids.reshape(-1)
    device = ids.device
    e_pad = _next_pow2(num_experts)
    chunk = chunk or max(16, 8192 // e_pad)
    chunks = -(-num_pairs // chunk)
    slots = torch.empty(max_slots(num_pairs, num_experts, block_m), dtype=torch.int32, device=device)
    ends = torch.empty(num_experts, dtype=torch.int32, device=device)
    common = dict(E=num_experts, E_PAD=e_pad, CHUNK=chunk)
    if chunks <= 1:
        _kernels.moe_align_kernel[(1,)](ids, ends, ends, slots, ends, num_pairs, 1, CHUNK_ROWS=16, BLOCK_M=block_m,
                                        SINGLE=True, num_warps=4, **common)
        return slots, ends
    counts = torch.empty((chunks, e_pad), dtype=torch.int32, device=device)
    ranks = torch.empty(num_pairs, dtype=torch.int32, device=device)
    _kernels.moe_count_kernel[(chunks,)](ids, counts, ranks, num_pairs, num_warps=4, **common)
    _kernels.moe_align_kernel[(chunks,)](ids, counts, ranks, slots, ends, num_pairs, chunks,
                                         CHUNK_ROWS=max(1, min(32, 4096 // e_pad)), BLOCK_M=block_m, SINGLE=False,
                                         num_warps=4, **common)
    return slots, ends


def _format_args(w: ExpertWeights) -> Tuple[Tensor, Tensor, int, int, int, int]:
    """(scales, offsets, their expert, row and group strides, the kernels' FORMAT) of a stack (dummies for
    dense)."""
    if w.format == "dense":
        return w.data, w.data, 0, 0, 0, 0
    scales = w.scales
    offsets = w.offsets if w.offsets is not None else scales
    return scales, offsets, scales.stride(0), scales.stride(1), scales.stride(2), FORMATS.index(w.format)


def _check(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, gate_up: ExpertWeights, down: ExpertWeights,
           gate_up_bias: Optional[Tensor], down_bias: Optional[Tensor], activation: str) -> None:
    n, h = x.shape
    e, two_i, h1 = gate_up.shape
    if two_i % 2 or h1 != h or down.shape != (e, h, two_i // 2):
        raise ValueError(f"gate_up {gate_up.shape} and down {down.shape} do not fit x {tuple(x.shape)}: gate_up "
                         f"[E, 2I, H], down [E, H, I]")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != n or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must be "
                         f"[{n}, k]")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is not one of {ACTIVATIONS}")
    for name, w in (("gate_up", gate_up), ("down", down)):
        if w.format not in FORMATS:
            raise ValueError(f"{name}: unknown format {w.format!r}")
        if w.data.stride(-1) != 1:
            raise ValueError(f"{name}'s rows must be contiguous")
        if w.format != "dense" and (w.shape[2] % GROUP or w.scales is None
                                    or w.scales.shape != (e, w.shape[1], w.shape[2] // GROUP)
                                    or (w.format == "int4" and (w.offsets is None
                                                                or w.offsets.stride() != w.scales.stride()))):
            raise ValueError(f"{name}: {w.format} needs inputs in groups of {GROUP} and scales [E, out, in/{GROUP}]")
    for name, b, size in (("gate_up_bias", gate_up_bias, two_i), ("down_bias", down_bias, h)):
        if b is not None and (b.shape != (e, size) or b.stride(-1) != 1):
            raise ValueError(f"{name} must be [{e}, {size}] with contiguous rows, got {tuple(b.shape)}")


def _launch(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, gate_up: ExpertWeights, down: ExpertWeights,
            gate_up_bias: Optional[Tensor], down_bias: Optional[Tensor], activation: str, alpha: float,
            limit: float, config: Optional[MoeConfig]) -> Tensor:
    _check(x, topk_ids, topk_weights, gate_up, down, gate_up_bias, down_bias, activation)
    n, hidden = x.shape
    num_experts, two_i, _ = gate_up.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    num_pairs = n * top_k
    out = torch.empty_like(x)
    if n == 0:
        return out
    cfg = config if config is not None else moe_config(num_pairs, num_experts, hidden, inter,
                                                       gate_up.format != "dense")
    x = x if x.stride(-1) == 1 else x.contiguous()
    ids = topk_ids.contiguous()
    routing = topk_weights.contiguous()
    slots, ends = align(ids, num_experts, cfg.block_m, cfg.align_chunk)
    blocks = slots.shape[0] // cfg.block_m + (slots.shape[0] % cfg.block_m > 0)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    e_pad = _next_pow2(num_experts)

    act = torch.empty((slots.shape[0], inter), dtype=x.dtype, device=x.device)
    s, o, sse, ssn, ssg, fmt = _format_args(gate_up)
    g = cfg.gate_up
    _kernels.moe_gate_up_kernel[(blocks * -(-inter // g.block_n),)](
        x, gate_up.data, s, o, x if gate_up_bias is None else gate_up_bias, slots, ends, act, num_pairs,
        x.stride(0), gate_up.data.stride(0), gate_up.data.stride(1), sse, ssn, ssg,
        0 if gate_up_bias is None else gate_up_bias.stride(0), float(alpha), float(limit),
        E=num_experts, E_PAD=e_pad, TOP_K=top_k, K=hidden, I=inter, BLOCK_M=cfg.block_m, BLOCK_N=g.block_n,
        BLOCK_K=g.block_k, FORMAT=fmt, ACTIVATION=ACTIVATIONS.index(activation), HAS_BIAS=gate_up_bias is not None,
        EVEN_K=hidden % g.block_k == 0, PRECISION=precision, ASM=x.is_cuda, num_warps=g.warps, num_stages=g.stages)

    parts = torch.empty((num_pairs, hidden), dtype=torch.float32, device=x.device)
    s, o, sse, ssn, ssg, fmt = _format_args(down)
    d = cfg.down
    _kernels.moe_down_kernel[(blocks * -(-hidden // d.block_n),)](
        act, down.data, s, o, act if down_bias is None else down_bias, slots, ends, routing, parts, num_pairs,
        down.data.stride(0), down.data.stride(1), sse, ssn, ssg, 0 if down_bias is None else down_bias.stride(0),
        E=num_experts, E_PAD=e_pad, K=inter, H=hidden, BLOCK_M=cfg.block_m, BLOCK_N=d.block_n, BLOCK_K=d.block_k,
        FORMAT=fmt, HAS_BIAS=down_bias is not None, EVEN_K=inter % d.block_k == 0, PRECISION=precision,
        ASM=x.is_cuda, num_warps=d.warps, num_stages=d.stages)

    block_h = min(1024, _next_pow2(hidden))
    _kernels.moe_sum_kernel[(n, -(-hidden // block_h))](parts, ids, out, E=num_experts, TOP_K=top_k, H=hidden,
                                                         BLOCK_H=block_h, num_warps=4)
    return out


def runs_triton(x: Tensor) -> bool:
    """Whether `fused_experts` takes the Triton kernels for x (CUDA, or CPU under TRITON_INTERPRET=1)."""
    return _kernels is not None and (x.is_cuda or (x.is_cpu and os.environ.get("TRITON_INTERPRET", "0") == "1"))


def fused_experts(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, gate_up, down,
                  gate_up_bias: Optional[Tensor] = None, down_bias: Optional[Tensor] = None,
                  activation: str = "silu", alpha: float = 1.702, limit: float = 7.0,
                  config: Optional[MoeConfig] = None) -> Tensor:
    """The routed experts' output [N, H] in x's dtype for x [N, H], topk_ids [N, k] (int32/int64), topk_weights
    [N, k] (float32), gate_up [E, 2I, H] and down [E, H, I] (float tensors or `ExpertWeights`), optional biases
    gate_up_bias [E, 2I] and down_bias [E, H]. `config`: tiles instead of `moe_config`'s (bench/moe_kernel.py)."""
    gate_up, down = _as_experts(gate_up), _as_experts(down)
    if runs_triton(x):
        return _launch(x, topk_ids, topk_weights, gate_up, down, gate_up_bias, down_bias, activation, alpha, limit,
                       config)
    return moe_reference(x, topk_ids, topk_weights, gate_up, down, gate_up_bias, down_bias, activation, alpha, limit)
