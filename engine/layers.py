"""Building blocks shared by the decoders: RMSNorm, rotary embeddings, attention over the KV cache, gated MLPs."""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig, RopeConfig
from .batch import ForwardBatch
from .kv_cache import PagedKVCache, window_span


def rms_norm(x: torch.Tensor, weight: torch.Tensor, doubled: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm of x [..., d] times `weight`, computed in float32; `doubled` is [weight, 0] in float32 (bf16 CPU path).

    bfloat16 on CPU: the RMS norm of x is the layer norm of [x, -x] (mean 0, variance mean(x^2)), and torch's fused
    CPU layer_norm (float32 inside, mixed-type weight) takes half the time of its rms_norm with the float32 round
    trip: the norms of a decode step went from 15 to 7 us each.
    """
    d = x.shape[-1]
    if x.dtype == torch.float32 or not x.is_cpu:
        return torch.rms_norm(x.float(), [d], weight.float(), eps).to(x.dtype)
    y = F.layer_norm(torch.cat((x, x.neg()), dim=-1), [2 * d], doubled, None, eps)
    return y[..., :d].contiguous()


def doubled_norm_weight(weight: torch.Tensor) -> torch.Tensor:
    """[weight, 0] in float32: the layer-norm weight of `rms_norm`'s bfloat16 CPU path."""
    return torch.cat((weight.float(), torch.zeros_like(weight.float())))


class RMSNorm(nn.Module):
    """RMS normalisation computed in float32; the weight is the final multiplier (gemma's 1 + w folded in at load)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps
        self._doubled: tuple[torch.Tensor, torch.Tensor] | None = None  # (weight, its doubled_norm_weight)

    def doubled(self) -> torch.Tensor:
        if self._doubled is None or self._doubled[0] is not self.weight:
            self._doubled = (self.weight, doubled_norm_weight(self.weight))
        return self._doubled[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.doubled(), self.eps)


def rope_inv_freq(rope: RopeConfig, head_dim: int, freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] in float32, with llama3 or linear scaling applied."""
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if freq_factors is not None:  # llama.cpp stores llama3 scaling as per-frequency divisors
        return inv / freq_factors.float()
    s = rope.scaling
    if not s:
        return inv
    factor = float(s["factor"])
    if s["rope_type"] == "linear":
        return inv / factor
    low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_ctx = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sign-folded sin [N, 1, head_dim] of `positions` [N], the tables `apply_rope` takes."""
    angles = positions.float().unsqueeze(-1) * inv_freq
    cos, sin = angles.cos(), angles.sin()
    return (torch.cat((cos, cos), dim=-1).to(dtype).unsqueeze(-2),
            torch.cat((-sin, sin), dim=-1).to(dtype).unsqueeze(-2))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [N, H, D] by cos / signed sin [N, 1, D]: x * cos + rotate_half(x) * sin in three ops."""
    return torch.addcmul(x * cos, torch.roll(x, x.shape[-1] // 2, dims=-1), signed_sin)


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: Optional[torch.Tensor],
                     num_kv_heads: int, scale: float) -> torch.Tensor:
    """One query per row: q [B, H, D], keys/values [B, kv_heads, L, D], mask [B, 1, 1, L] → [B, H, D].

    Plain batched matmuls with the query heads of a KV group stacked: torch's fused CPU attention is tuned for long
    queries and is 5-20x slower than this for a single bfloat16 query.
    """
    b, h, d = q.shape[0], q.shape[1], q.shape[2]
    rows = b * num_kv_heads
    # float32 throughout: more accurate, and torch's small float32 batched matmuls are 2-3x faster on CPU than its
    # bfloat16 ones, converting included. bmm on 3-d views: matmul's broadcasting costs more than these tiny products.
    qg = q.float().reshape(rows, h // num_kv_heads, d)
    scores = torch.bmm(qg, keys.float().reshape(rows, -1, d).transpose(1, 2))  # [B * kvh, g, L]
    scores.mul_(scale)
    if mask is not None:
        scores.view(b, num_kv_heads, -1, scores.shape[-1]).masked_fill_(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.bmm(probs, values.float().reshape(rows, -1, d))
    return out.view(b, h, d).to(q.dtype)


def gated_activation(gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:
    """act(gate) * up of the concatenated [gate, up] projection: SwiGLU, or GeGLU with tanh GELU."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)
    return gate * up


class Attention(nn.Module):
    """Multi-head attention with grouped KV heads, optional biases and q/k norms, reading and writing the KV cache."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer, self.cfg = layer, cfg
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        # q, k and v in one matmul (the loader concatenates the checkpoint's three projections).
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_eps) if cfg.qk_norm else None
        self.rope = "local" if cfg.layer_is_sliding[layer] and cfg.local_rope else "global"
        self.sliding = cfg.layer_is_sliding[layer]

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: PagedKVCache) -> torch.Tensor:
        """x [N, hidden]: the flat new tokens of every row of `batch`."""
        n = x.shape[0]
        qkv = self.qkv_proj(x).view(n, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        qk, v = qkv[:, :self.num_heads + self.num_kv_heads], qkv[:, self.num_heads + self.num_kv_heads:]
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :self.num_heads]), self.k_norm(qk[:, self.num_heads:])), dim=1)
        qk = apply_rope(qk, *batch.rope[self.rope])  # q and k heads rotated together
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        cache.write(self.layer, batch.slots, k, v)
        out = None
        if (group := batch.decode) is not None:
            if group.key_span is not None:
                # only the window's keys are visible
                first, length = window_span(*group.key_span, self.cfg.sliding_window if self.sliding else 0)
                keys, values = cache.span(self.layer, first, length)
                mask = None
            else:
                keys, values = cache.gather(self.layer, group.key_blocks)  # [Bd, kv_heads, L, D]
                mask = group.sliding_mask if self.sliding else group.full_mask
            o = decode_attention(q[:group.size], keys, values, mask, self.num_kv_heads, self.cfg.query_scale)
            if group.size == n:  # a pure decode step, the common case
                return self.o_proj(o.reshape(n, -1))
            out = torch.empty_like(q)
            out[:group.size] = o
        out = torch.empty_like(q) if out is None else out
        for row in batch.prefills:
            if row.key_blocks is None:  # a fresh sequence: its keys are exactly the chunk's own
                keys, values = k[row.begin:row.end].transpose(0, 1), v[row.begin:row.end].transpose(0, 1)
            else:
                keys, values = cache.gather(self.layer, row.key_blocks)
            mask = row.sliding_mask if self.sliding else row.full_mask
            o = F.scaled_dot_product_attention(
                q[row.begin:row.end].transpose(0, 1).unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
                attn_mask=mask, is_causal=mask is None, scale=self.cfg.query_scale,
                enable_gqa=self.num_kv_heads != self.num_heads)
            out[row.begin:row.end] = o[0].transpose(0, 1)
        return self.o_proj(out.view(n, -1))


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU for llama/qwen, GeGLU (tanh GELU) for gemma."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # gate and up in one matmul (the loader concatenates the checkpoint's two projections).
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gelu = cfg.hidden_act == "gelu_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated_activation(self.gate_up_proj(x), self.gelu))
