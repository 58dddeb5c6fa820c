"""Building blocks shared by the decoders: RMSNorm, rotary embeddings, linear layers, attention over the paged KV
cache, gated MLPs.

One definition serves every device and path: the modules run eagerly (GPU steps, captured in CUDA graphs per batch
bucket), or scripted as one TorchScript call on CPU (engine/model/decoder.py), from the same code. Everything a layer
needs of the step comes in its `ForwardBatch`.
"""
# No `from __future__ import annotations`: TorchScript reads the annotations of what it compiles as types.
import math
import os
from typing import List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.kernels import gemv
from engine.model.batch import ForwardBatch
from engine.config import ModelConfig, RopeConfig, yarn_mscale
from engine.kernels.fused import CPU_KERNELS, gated_activation, rms_norm, rope_and_write_kv
from engine.cache.kv_cache import gather_blocks, window_span

# Dense matmuls see row counts rounded up to a multiple of this: with every prompt length its own shape, the
# allocator's and oneDNN's per-shape state kept growing (bench/rss_soak.py,
# bench/RESULTS.md#issue-5-cpu-dense-prefill); with 32 shapes up to a 512-token chunk it is flat. At most 15 rows
# of extra work. It also makes a row's result independent of how many rows share the call (a single-row call would
# take a different kernel), which deterministic steps rely on.
DENSE_ROW_BUCKET = 16

# CPU decode rows, and short chunks over cached blocks, attend through their block tables with the compiled kernels
# (engine/kernels/cpu.py) when they are there: keys read in place, no gather, no float32 copies. Under Triton's interpreter
# (tests) CPU tensors take the Triton kernels instead.
CPU_PAGED_DECODE = CPU_KERNELS and os.environ.get("TRITON_INTERPRET", "0") != "1"
if CPU_PAGED_DECODE:  # a function for TorchScript, which takes no global values (see fused_kernels.cpu_kernels_on)
    def cpu_paged_decode() -> bool:
        return True
else:
    def cpu_paged_decode() -> bool:
        return False


def doubled_norm_weight(weight: Tensor) -> Tensor:
    """[weight, 0] in float32: the layer-norm weight of `rms_norm`'s bfloat16 CPU path."""
    if weight.is_meta:  # a model being built: its shape only (meta ops would import torch._dynamo, see embedding_table)
        return torch.empty(2 * weight.shape[0], dtype=torch.float32, device="meta")
    return torch.cat((weight.float(), torch.zeros_like(weight.float())))


class RMSNorm(nn.Module):
    """RMS normalisation computed in float32; the weight is the final multiplier (gemma's 1 + w folded in at load)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.register_buffer("doubled", doubled_norm_weight(self.weight), persistent=False)
        self.eps = eps

    def refresh(self) -> None:
        """Recompute what derives from the weight, once it is loaded."""
        self.doubled = doubled_norm_weight(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps, self.doubled)


def dense_matmul(x: Tensor, w: Tensor, bias: Optional[Tensor] = None, bucket: int = DENSE_ROW_BUCKET) -> Tensor:
    """x @ w^T (+ bias) with the rows padded to a multiple of `bucket`."""
    m = x.shape[0]
    pad = -m % bucket
    return F.linear(x if pad == 0 else F.pad(x, (0, 0, 0, pad)), w, bias)[:m]


def tiled_matmul(x: Tensor, w: Tensor, bias: Optional[Tensor] = None, tile: int = DENSE_ROW_BUCKET) -> Tensor:
    """x @ w^T (+ bias) as calls of exactly `tile` rows each (the last padded), so every row's sums are those of
    one fixed-shape kernel call, however many rows the step has.

    Padding alone is not enough: MKL picks its blocking along the inner dimension by the row count (float32 on an
    AVX-512 Xeon: a [64, 1536] call sums a row differently from a [48, 1536] one), so a token's logits would
    depend on its chunk's length. Within one shape a row's result does not depend on where it sits among the
    others (tests/engine/model/test_layers.py checks both).
    """
    m = x.shape[0]
    pad = -m % tile
    padded = x if pad == 0 else F.pad(x, (0, 0, 0, pad))
    if padded.shape[0] == tile:
        return F.linear(padded, w, bias)[:m]
    return torch.cat([F.linear(part, w, bias) for part in padded.split(tile)])[:m]


class Linear(nn.Linear):
    """A dense linear layer called like the packed ones (quant.PackedLinear): x [M, in] and the step's routing.

    Deterministic steps on CPU take fixed-shape calls (tiled_matmul): a one-row call would take a matrix-vector
    kernel, and calls of different row counts sum in different orders. One-row calls on a GPU take engine/kernels/gemv.py.
    """

    def forward(self, x: Tensor, packed_rows: int = 0, deterministic: bool = False) -> Tensor:
        if deterministic and x.is_cpu:
            return tiled_matmul(x, self.weight, self.bias)
        if not torch.jit.is_scripting():
            if gemv.serves(x, self.weight):
                return gemv.gemv(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def embedding_table(rows: int, dim: int) -> nn.Embedding:
    """An embedding of `rows` vectors left uninitialised (its weights are loaded next): built on the meta device,
    nn.Embedding's own random init goes through torch's Python decompositions, whose first use imports
    torch._dynamo (about a second of every model load)."""
    return nn.Embedding.from_pretrained(torch.empty(rows, dim), freeze=True)


def rope_inv_freq(rope: RopeConfig, head_dim: int, freq_factors: Optional[Tensor] = None) -> Tensor:
    """Inverse frequencies [head_dim / 2] in float32, with llama3, linear or yarn scaling applied."""
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if freq_factors is not None:  # llama.cpp stores llama3 scaling as per-frequency divisors
        return inv / freq_factors.float()
    s = rope.scaling
    if not s:
        return inv
    if s["rope_type"] == "yarn":
        return yarn_inv_freq(rope.theta, head_dim, s)
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


def yarn_inv_freq(theta: float, head_dim: int, s: dict) -> Tensor:
    """YaRN's inverse frequencies (arXiv 2309.00071), as transformers' `_compute_yarn_parameters` computes them:
    the fast-rotating dimensions kept (extrapolated), the slow ones divided by `factor` (interpolated), a linear
    ramp between the dimensions that turn `beta_fast` and `beta_slow` times over the original context; `truncate`
    (default True) rounds the ramp's ends to whole dimensions."""
    factor, old_ctx = float(s["factor"]), float(s["original_max_position_embeddings"])
    beta_fast, beta_slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def dimension(rotations: float) -> float:  # the dimension that turns `rotations` times over the old context
        return head_dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(beta_fast), dimension(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolated = 1 - ramp  # the share of each dimension's frequency kept as it is
    return 1.0 / (factor * pos_freqs) * (1 - extrapolated) + 1.0 / pos_freqs * extrapolated


def rope_attention_factor(rope: Optional[RopeConfig]) -> float:
    """What cos and sin are multiplied by: YaRN's attention factor (`attention_factor`, else from `factor` and the
    optional `mscale` / `mscale_all_dim`, as transformers computes it), 1 for every other rope."""
    s = rope.scaling if rope is not None else None
    if not s or s["rope_type"] != "yarn":
        return 1.0
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor = float(s["factor"])
    m, m_all = s.get("mscale"), s.get("mscale_all_dim")
    if m and m_all:
        return float(yarn_mscale(factor, float(m)) / yarn_mscale(factor, float(m_all)))
    return yarn_mscale(factor)


def rope_cos_sin(inv_freq: Tensor, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sign-folded sin [N, 1, head_dim] of `positions` [N], the tables `apply_rope` takes."""
    return rope_lookup(*rope_table(inv_freq, positions, dtype), None)


def rope_table(inv_freq: Tensor, positions: Tensor, dtype: torch.dtype,
               factor: float = 1.0) -> tuple[Tensor, Tensor]:
    """cos and sin [N, head_dim / 2] of `positions` [N] in `dtype`, from float32 angles, times `factor` (yarn's
    attention factor, `rope_attention_factor`) in float32 before the rounding."""
    angles = positions.float().unsqueeze(-1) * inv_freq
    cos, sin = angles.cos(), angles.sin()
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return cos.to(dtype), sin.to(dtype)


def rope_lookup(cos: Tensor, sin: Tensor, positions: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """`rope_cos_sin`'s tables from a `rope_table` (rows `positions` of it; None: all its rows)."""
    if positions is not None:
        cos, sin = cos.index_select(0, positions), sin.index_select(0, positions)
    # Rounding to `dtype` before the cat and the sign flip gives the same numbers as after them.
    return torch.cat((cos, cos), dim=-1).unsqueeze(-2), torch.cat((-sin, sin), dim=-1).unsqueeze(-2)


class RopeTables(NamedTuple):
    """cos / signed sin of a step's positions, for global layers and (gemma3) the local rope of sliding layers."""

    cos: Tensor
    sin: Tensor
    local_cos: Tensor
    local_sin: Tensor


def with_sinks(scores: Tensor, sinks: Tensor) -> Tensor:
    """Softmax of `scores` [..., L] (a row of -inf: all zeros) with each row's attention sink, a logit `sinks`
    broadcast to [..., 1] that joins the softmax and has no value: softmax over [scores, sink], the sink dropped
    (transformers' gpt-oss `eager_attention_forward`)."""
    sink = sinks.to(scores.dtype).expand(list(scores.shape[:-1]) + [1])
    return torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]


def decode_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Optional[Tensor], num_kv_heads: int,
                     scale: float, sinks: Optional[Tensor] = None) -> Tensor:
    """One query per row: q [B, H, D], keys/values [B, kv_heads, L, D], mask [B, 1, 1, L], sinks [H] float32
    (None: no attention sinks) → [B, H, D].

    Plain batched matmuls with the query heads of a KV group stacked: torch's fused CPU attention is tuned for long
    queries and is many times slower than this for a single bfloat16 query (bench/RESULTS.md#issue-5-decode-profile).
    """
    b, h, d = q.shape[0], q.shape[1], q.shape[2]
    rows = b * num_kv_heads
    # float32 throughout: more accurate, and torch's small float32 batched matmuls are faster on CPU than its
    # bfloat16 ones, converting included (bench/RESULTS.md#issue-32-cpu-decode-attention-float32). bmm on 3-d
    # views: matmul's broadcasting costs more than these tiny products.
    qg = q.float().reshape(rows, h // num_kv_heads, d)
    scores = torch.bmm(qg, keys.float().reshape(rows, -1, d).transpose(1, 2))  # [B * kvh, g, L]
    scores.mul_(scale)
    if mask is not None:
        scores.view(b, num_kv_heads, -1, scores.shape[-1]).masked_fill_(~mask, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:  # row b * kvh + j, query head i of its group: head j * g + i
        probs = with_sinks(scores.view(b, num_kv_heads, h // num_kv_heads, -1),
                           sinks.view(num_kv_heads, h // num_kv_heads, 1)).reshape(rows, h // num_kv_heads, -1)
    out = torch.bmm(probs, values.float().reshape(rows, -1, d))
    return out.view(b, h, d).to(q.dtype)


def exact_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Optional[Tensor], num_kv_heads: int,
                    scale: float, sinks: Optional[Tensor] = None) -> Tensor:
    """q [B, T, H, D], keys/values [B, kv_heads, L, D], mask [B, 1, T, L] bool (None: all visible), sinks [H]
    (None: no attention sinks) → [B, T, H, D].

    Float64 throughout, rounded to q's dtype at the end: products of bfloat16 (or float32) values are exact in
    float64, and the sums of a softmax or of its weighted values differ by a few float64 ulps between orders or
    key paddings, far below what the rounding keeps. So a query's result is the same whatever its neighbours, its
    row layout, its chunk or how its keys are laid out (deterministic steps).
    """
    b, t, h, d = q.shape[0], q.shape[1], q.shape[2], q.shape[3]
    g = h // num_kv_heads
    length = keys.shape[2]
    qg = q.double().reshape(b, t, num_kv_heads, g, d).permute(0, 2, 1, 3, 4).reshape(b, num_kv_heads, t * g, d)
    scores = torch.matmul(qg, keys.double().transpose(-1, -2)).mul_(scale)  # [B, kvh, T * g, L]
    if mask is not None:
        view = scores.view(b, num_kv_heads, t, g, length)
        view.masked_fill_(~mask.reshape(b, 1, t, 1, length), float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:  # row t * g + i of KV head j: query head j * g + i
        probs = with_sinks(scores.view(b, num_kv_heads, t, g, length),
                           sinks.view(num_kv_heads, 1, g, 1)).reshape(b, num_kv_heads, t * g, length)
    out = torch.matmul(probs, values.double())  # [B, kvh, T * g, D]
    return out.view(b, num_kv_heads, t, g, d).permute(0, 2, 1, 3, 4).reshape(b, t, h, d).to(q.dtype)


# Queries of a prefill row with attention sinks take the softmax a tile at a time: the scores of a whole chunk (a
# 2,048-token chunk of 64 heads) would need gigabytes.
SINK_QUERY_TILE = 256


def sink_prefill_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Optional[Tensor], num_kv_heads: int,
                           scale: float, sinks: Tensor, tile: int = SINK_QUERY_TILE) -> Tensor:
    """Attention with sinks of one prefill row's queries q [T, H, D] over its keys/values [kv_heads, L, D], mask
    [1, 1, T, L] bool (None: causal, L = T) → [T, H, D], in float32, `tile` queries at a time: the path of
    `attend`'s rows that take torch's fused attention without sinks (which cannot add a sink to its softmax)."""
    t, h, d = q.shape[0], q.shape[1], q.shape[2]
    g = h // num_kv_heads
    out = torch.empty_like(q)
    k32, v32 = keys.float(), values.float()
    head_sinks = sinks.view(num_kv_heads, 1, g, 1)
    for start in range(0, t, tile):
        n = min(tile, t - start)
        length = k32.shape[1] if mask is not None else start + n  # causal: keys past the tile's last query unseen
        qg = q[start:start + n].float().view(n, num_kv_heads, g, d).transpose(0, 1).reshape(num_kv_heads, n * g, d)
        scores = torch.bmm(qg, k32[:, :length].transpose(1, 2)).mul_(scale).view(num_kv_heads, n, g, length)
        if mask is not None:
            visible = mask[0, 0, start:start + n]
        else:
            pos = torch.arange(length, device=q.device)
            visible = pos.unsqueeze(0) <= (pos[start:start + n]).unsqueeze(1)
        scores.masked_fill_(~visible.view(1, n, 1, length), float("-inf"))
        probs = with_sinks(scores, head_sinks).reshape(num_kv_heads, n * g, length)
        o = torch.bmm(probs, v32[:, :length])  # [kvh, n * g, D]
        out[start:start + n] = o.view(num_kv_heads, n, g, d).transpose(0, 1).reshape(n, h, d).to(q.dtype)
    return out


def causal_mask(length: int, window: int, device: torch.device) -> Tensor:
    """[1, 1, T, T] bool: query i sees keys j <= i (and i - j < window when window > 0)."""
    pos = torch.arange(length, device=device)
    mask = pos.unsqueeze(0) <= pos.unsqueeze(1)
    if window > 0:
        mask &= pos.unsqueeze(0) > pos.unsqueeze(1) - window
    return mask.view(1, 1, length, length)


@torch.jit.unused
def _paged_decode(q: Tensor, keys: Tensor, values: Tensor, block_tables: Tensor, seq_lens: Tensor,
                  block_size: int, scale: float, window: int, sinks: Optional[Tensor]) -> Tensor:
    from engine.kernels.paged_attention import paged_decode_attention

    return paged_decode_attention(q, keys, values, block_tables, seq_lens, block_size, scale, window, sinks=sinks)


@torch.jit.unused
def _paged_prefill(q: Tensor, keys: Tensor, values: Tensor, tables: Tensor, rows: Tensor, block_size: int,
                   scale: float, window: int, max_query: int, out: Tensor, sinks: Optional[Tensor]) -> Tensor:
    from engine.kernels.paged_attention import paged_prefill_attention

    return paged_prefill_attention(q, keys, values, tables, rows[2], rows[1], rows[0], block_size, scale,
                                   window, out=out, max_query_len=max_query, sinks=sinks)


def attend_decode(q: Tensor, keys: Tensor, values: Tensor, batch: ForwardBatch, window: int, scale: float,
                  num_kv_heads: int, sinks: Optional[Tensor] = None) -> Tensor:
    """Attention of the batch's decode rows q [Bd, H, D] over their cached keys → [Bd, H, D]; `sinks` [H] float32:
    the heads' attention sinks (None: none)."""
    tables, lengths = batch.block_tables, batch.seq_lens  # locals: TorchScript refines Optional types of names only
    if tables is not None and lengths is not None:
        if cpu_paged_decode() and q.is_cpu:
            return torch.ops.emberserve.paged_decode_attention(q, keys, values, tables, lengths, batch.block_size,
                                                               scale, window, sinks)
        return _paged_decode(q, keys, values, tables, lengths, batch.block_size, scale, window, sinks)
    if batch.span_length > 0:  # one row whose keys are consecutive slots, read in place; only the window's visible
        first, length = window_span(batch.span_first, batch.span_length, window)
        k_all, v_all = keys[:, first:first + length].unsqueeze(0), values[:, first:first + length].unsqueeze(0)
        mask: Optional[Tensor] = None
    else:
        key_blocks = batch.key_blocks
        assert key_blocks is not None
        k_all = gather_blocks(keys, key_blocks, batch.block_size)
        v_all = gather_blocks(values, key_blocks, batch.block_size)
        mask = batch.sliding_mask if window > 0 else batch.full_mask
    if batch.deterministic:
        return exact_attention(q.unsqueeze(1), k_all, v_all, mask, num_kv_heads, scale, sinks)[:, 0]
    return decode_attention(q, k_all, v_all, mask, num_kv_heads, scale, sinks)


def attend(q: Tensor, k: Optional[Tensor], v: Tensor, keys: Tensor, values: Tensor, batch: ForwardBatch,
           window: int, scale: float, num_kv_heads: int, sinks: Optional[Tensor] = None) -> Tensor:
    """Attention of every new token q [N, H, D] (its own k, v [N, kv_heads, D] already in the cache; k needed only
    when the batch has a fresh prefill row, which attends over its own keys) → [N, H, D]; `sinks` [H] float32:
    the heads' attention sinks (None: none)."""
    n, bd = q.shape[0], batch.decode_rows
    if bd == n:  # a pure decode step, the common case
        return attend_decode(q, keys, values, batch, window, scale, num_kv_heads, sinks)
    out = torch.empty_like(q)
    if bd > 0:
        out[:bd] = attend_decode(q[:bd], keys, values, batch, window, scale, num_kv_heads, sinks)
    gqa = num_kv_heads != q.shape[1]
    for i in range(len(batch.prefill_begins)):
        begin, end = batch.prefill_begins[i], batch.prefill_ends[i]
        key_blocks = batch.prefill_key_blocks[i]
        mask = batch.prefill_sliding_masks[i] if window > 0 else batch.prefill_full_masks[i]
        if key_blocks is None:
            assert k is not None
            row_keys, row_values = k[begin:end].transpose(0, 1), v[begin:end].transpose(0, 1)
        else:
            row_keys = gather_blocks(keys, key_blocks, batch.block_size)
            row_values = gather_blocks(values, key_blocks, batch.block_size)
        if batch.deterministic:
            if mask is None:
                mask = causal_mask(end - begin, window, q.device)
            out[begin:end] = exact_attention(q[begin:end].unsqueeze(0), row_keys.unsqueeze(0),
                                             row_values.unsqueeze(0), mask, num_kv_heads, scale, sinks)[0]
            continue
        if sinks is not None:
            out[begin:end] = sink_prefill_attention(q[begin:end], row_keys, row_values, mask, num_kv_heads, scale,
                                                    sinks)
            continue
        o = F.scaled_dot_product_attention(
            q[begin:end].transpose(0, 1).unsqueeze(0), row_keys.unsqueeze(0), row_values.unsqueeze(0),
            attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa)
        out[begin:end] = o[0].transpose(0, 1)
    paged, tables = batch.paged_prefill, batch.prefill_tables
    if paged is not None and tables is not None:  # the rows over cached blocks (GPU; short chunks on CPU)
        if cpu_paged_decode() and q.is_cpu:
            return torch.ops.emberserve.paged_prefill_attention(q, keys, values, tables, paged[2], paged[1], paged[0],
                                                                batch.block_size, scale, window, out, sinks)
        out = _paged_prefill(q, keys, values, tables, paged, batch.block_size, scale, window,
                             batch.prefill_max_query, out, sinks)
    return out


class Attention(nn.Module):
    """Multi-head attention with grouped KV heads, optional biases, q/k norms (per head, or OLMoE's over all heads'
    features) and attention sinks (gpt-oss), reading and writing the KV cache."""

    sinks: Optional[Tensor]

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        # q, k and v in one matmul (the loader concatenates the checkpoint's three projections).
        self.qkv_proj = Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.qk_norm = bool(cfg.qk_norm)
        self.qk_norm_per_head = bool(cfg.qk_norm_per_head)
        q_norm_dim, k_norm_dim = (cfg.head_dim, cfg.head_dim) if cfg.qk_norm_per_head else (q_size, kv_size)
        self.q_norm = RMSNorm(q_norm_dim, cfg.rms_eps) if cfg.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(k_norm_dim, cfg.rms_eps) if cfg.qk_norm else nn.Identity()
        # A learned logit per head that joins its every softmax, float32 (attend's `sinks`); None without.
        self.sinks = (nn.Parameter(torch.zeros(cfg.num_heads, dtype=torch.float32), requires_grad=False)
                      if cfg.attention_sinks else None)
        self.sliding = bool(cfg.layer_is_sliding[layer])
        self.local_rope = self.sliding and cfg.local_rope is not None
        self.window = int(cfg.sliding_window or 0) if self.sliding else 0
        self.scale = float(cfg.query_scale)

    def forward(self, x: Tensor, batch: ForwardBatch, rope: RopeTables, keys: Tensor, values: Tensor) -> Tensor:
        """x [N, hidden]: the flat new tokens of every row of `batch`; keys/values: this layer's cache."""
        n, h, kvh = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x, batch.packed_rows, batch.deterministic).view(n, h + 2 * kvh, self.head_dim)
        qk, v = qkv[:, :h + kvh], qkv[:, h + kvh:]
        if self.qk_norm and self.qk_norm_per_head:
            qk = torch.cat((self.q_norm(qk[:, :h]), self.k_norm(qk[:, h:])), dim=1)
        elif self.qk_norm:  # OLMoE: each norm over all heads' features, before the heads are split
            qk = torch.cat((self.q_norm(qk[:, :h].reshape(n, -1)).view(n, h, self.head_dim),
                            self.k_norm(qk[:, h:].reshape(n, -1)).view(n, kvh, self.head_dim)), dim=1)
        cos, sin = (rope.local_cos, rope.local_sin) if self.local_rope else (rope.cos, rope.sin)
        # The rotated k only for rows that attend over their own keys (fresh prefills); the cache has them all.
        k = torch.empty((n, kvh, self.head_dim), dtype=x.dtype, device=x.device) if batch.prefill_begins else None
        q = rope_and_write_kv(qk, v, cos, sin, keys, values, batch.slots, k_out=k)
        out = attend(q, k, v, keys, values, batch, self.window, self.scale, kvh, self.sinks)
        return self.o_proj(out.reshape(n, -1), batch.packed_rows, batch.deterministic)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU for llama/qwen, GeGLU (tanh GELU) for gemma."""

    def __init__(self, cfg: ModelConfig, intermediate: int = 0) -> None:
        super().__init__()
        width = intermediate or cfg.intermediate_size  # a shared expert's own width (Qwen2-MoE)
        # gate and up in one matmul (the loader concatenates the checkpoint's two projections).
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * width, bias=False)
        self.down_proj = Linear(width, cfg.hidden_size, bias=False)
        self.gelu = cfg.hidden_act == "gelu_tanh"

    def forward(self, x: Tensor, packed_rows: int, deterministic: bool) -> Tensor:
        gate_up = self.gate_up_proj(x, packed_rows, deterministic)
        return self.down_proj(gated_activation(gate_up, self.gelu), packed_rows, deterministic)


class DecoderStack(nn.Module):
    """Every layer of a step: x [N, hidden] of the flat batch in; the last layer's branch and residual stream out
    (a block takes the previous block's branch and the residual, so that the add and the next norm are one kernel,
    engine/kernels/fused.py). Not a submodule of the model (it holds the model's own layers), so the same layers
    run eagerly or scripted (engine/model/decoder.py)."""

    def __init__(self, layers: nn.ModuleList) -> None:
        super().__init__()
        self.layers = layers

    def forward(self, x: Tensor, batch: ForwardBatch, rope: RopeTables, keys: List[Tensor],
                values: List[Tensor]) -> Tuple[Tensor, Tensor]:
        residual: Optional[Tensor] = None
        i = 0
        for layer in self.layers:
            x, residual = layer(x, residual, batch, rope, keys[i], values[i])
            i += 1
        assert residual is not None
        return x, residual
