"""`Shard`: which part of every weight a tensor-parallel rank holds (Megatron-style), and the load-time sharding.

Column-parallel (output rows split): the fused q/k/v projection (each of q, k and v split by heads) and the fused
gate/up projection (each of gate and up split); row-parallel (input columns split, partial sums all-reduced): o and
down; vocabulary-parallel: the embedding and the LM head (rows split, padded to a multiple of the world size).
KV heads are split when they divide by the world size; when the world size is a multiple of them, each KV head is
replicated on the ranks whose query heads read it (as vLLM does); anything else is refused. Norms are replicated.

Sharding happens on the checkpoint's tensors before any quantization (engine/loader/build.py), so each rank quantizes its
own share; the modules get their local shapes here, and their collectives from engine/parallel/layers.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.config import ModelConfig
from engine.errors import UnsupportedModelError
from engine.model.layers import Linear, embedding_table
from engine.model.moe import CheckpointExperts, MoEMLP
from engine.model.quant import GROUP_SIZE, Affine4Bit
from engine.model.quant.experts import dense_expert
from engine.model.quant.mxfp4 import MXFP4_BLOCK, Mxfp4Tensor
from engine.weights.lazy_experts import LazyExperts, form_of


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `size`, for a model of `cfg`'s shape: the index ranges of its heads, FFN and vocabulary."""

    rank: int
    size: int
    num_heads: int        # query heads of this rank
    num_kv_heads: int     # KV heads this rank holds (its pool's heads)
    first_kv_head: int
    intermediate: int     # FFN width of this rank
    vocab_rows: int       # embedding / LM-head rows per rank (the vocabulary padded to a multiple of `size`)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_rows


def check_shardable(cfg: ModelConfig, size: int) -> None:
    """Raise UnsupportedModelError (saying why) unless `cfg` splits over `size` ranks."""
    if size < 1:
        raise ValueError(f"tensor parallel size must be at least 1, got {size}")
    problems = []
    if cfg.num_heads % size:
        problems.append(f"{cfg.num_heads} attention heads")
    kv = cfg.num_kv_heads
    if kv % size and size % kv:
        problems.append(f"{kv} KV heads (neither a multiple nor a divisor of {size})")
    moe = cfg.moe
    if (moe is None or moe.dense_layers) and cfg.intermediate_size % size:
        problems.append(f"an FFN width of {cfg.intermediate_size}")
    if moe is not None and moe.expert_intermediate % size:
        problems.append(f"an expert FFN width of {moe.expert_intermediate}")
    if moe is not None and moe.shared_intermediate % size:
        problems.append(f"a shared expert FFN width of {moe.shared_intermediate}")
    if cfg.qk_norm and not cfg.qk_norm_per_head and size > 1:
        problems.append("q/k norms over all heads at once (OLMoE)")
    if problems:
        raise UnsupportedModelError(
            f"a {cfg.family} model with {', '.join(problems)} does not split over {size} tensor-parallel ranks; "
            "use a tensor parallel size that divides them")


def shard_of(cfg: ModelConfig, rank: int, size: int) -> Shard:
    """Rank `rank`'s share of `cfg` (checked with `check_shardable`)."""
    check_shardable(cfg, size)
    kv = cfg.num_kv_heads
    if kv >= size:  # split
        local_kv, first_kv = kv // size, rank * (kv // size)
    else:           # replicated: rank r's query heads all read KV head r * kv // size
        local_kv, first_kv = 1, rank * kv // size
    return Shard(rank, size, cfg.num_heads // size, local_kv, first_kv, cfg.intermediate_size // size,
                 -(-cfg.vocab_size // size))


Weight = Any  # a float tensor, an Affine4Bit (a GGUF file's 4-bit blocks, kept packed), MXFP4 or LazyExperts


def _rows(w: Weight, start: int, stop: int) -> Weight:
    if isinstance(w, Affine4Bit):
        return w.map_rows(lambda t: t[start:stop])
    if isinstance(w, Mxfp4Tensor):
        return w.rows(slice(start, stop))
    return w[start:stop]


_BLOCK = {"affine4bit": GROUP_SIZE, "mxfp4": MXFP4_BLOCK, "float": 1}  # inputs per 4-bit block, by form


def _columns(w: Weight, start: int, stop: int) -> Weight:
    block = _BLOCK[form_of(w)]
    if start % block or stop % block:  # the shard cuts a 4-bit block: requantized from floats
        return w.dequantize()[..., start:stop].contiguous()
    if isinstance(w, Affine4Bit):
        g0, g1 = start // GROUP_SIZE, stop // GROUP_SIZE
        return Affine4Bit(w.codes[:, start:stop].contiguous(), w.scale[:, g0:g1].contiguous(),
                          w.offset[:, g0:g1].contiguous())
    if isinstance(w, Mxfp4Tensor):
        return w.columns(start, stop).contiguous()
    return w[:, start:stop].contiguous()


def _cat_rows(parts: list[Weight]) -> Weight:
    if all(isinstance(p, Affine4Bit) for p in parts):
        return Affine4Bit.cat(parts)
    if all(isinstance(p, Mxfp4Tensor) for p in parts):
        return Mxfp4Tensor.cat(parts)
    return torch.cat([dense_expert(p) for p in parts])


def _pad_rows(w: Weight, rows: int) -> Weight:
    """`w` with zero rows appended up to `rows` (the last vocabulary shard)."""
    missing = rows - w.shape[0]
    if missing <= 0:  # a copy: a view would keep the whole checkpoint's table alive
        return w.map_rows(torch.clone) if isinstance(w, Affine4Bit) else w.clone()
    if isinstance(w, Affine4Bit):
        w = w.dequantize()
    return torch.cat((w, torch.zeros((missing, *w.shape[1:]), dtype=w.dtype)))


def _first_rank_only(state: dict[str, Weight], name: str, shard: Shard) -> None:
    """A bias added after a row-parallel sum: rank 0 adds it, the others add zeros."""
    if name in state and shard.rank:
        state[name] = torch.zeros_like(state[name])


def _shard_gated(state: dict[str, Weight], prefix: str, width: int, shard: Shard) -> None:
    """A gated MLP of FFN `width` (fused [gate | up], then down): this rank's slice of the width."""
    part = width // shard.size
    i0 = shard.rank * part
    w = state[f"{prefix}gate_up_proj.weight"]
    state[f"{prefix}gate_up_proj.weight"] = _cat_rows([_rows(w, i0, i0 + part),
                                                      _rows(w, width + i0, width + i0 + part)])
    state[f"{prefix}down_proj.weight"] = _columns(state[f"{prefix}down_proj.weight"], i0, i0 + part)


def _shard_experts(state: dict[str, Weight], prefix: str, cfg: ModelConfig, shard: Shard) -> None:
    """Tensor-parallel experts: every rank holds every expert and routes every token (the router is replicated),
    with its slice of each expert's FFN width; the layer's output is summed over the ranks (parallelize).

    The weights' shares are read an expert at a time when the layer's serving stacks are placed
    (engine/loader/experts.py), as unsplit ones are: no copy of every expert is made here, and 4-bit experts
    (GGUF blocks, MXFP4) stay exact where the split falls on their blocks' edges (rows always do)."""
    moe = cfg.moe
    assert moe is not None
    width = moe.expert_intermediate
    part = width // shard.size
    i0 = shard.rank * part
    gate, up = (i0, i0 + part), (width + i0, width + i0 + part)
    name = f"{prefix}experts.gate_up.weight"  # [E, gate (I) | up (I), hidden] → this rank's rows of each half
    experts = LazyExperts.of(state[name])
    state[name] = experts.map(lambda w: _cat_rows([_rows(w, *gate), _rows(w, *up)]), 2 * part,
                              experts.in_features, experts.form)
    bias = f"{prefix}experts.gate_up.bias"
    if bias in state:
        b = state[bias]
        state[bias] = torch.cat((b[:, slice(*gate)], b[:, slice(*up)]), dim=1).contiguous()
    name = f"{prefix}experts.down.weight"  # [E, hidden, I] → this rank's columns
    experts = LazyExperts.of(state[name])
    form = "float" if part % _BLOCK[experts.form] else experts.form  # (i0 is a multiple of part)
    state[name] = experts.map(lambda w: _columns(w, i0, i0 + part), experts.out_features, part, form)
    _first_rank_only(state, f"{prefix}experts.down.bias", shard)
    if moe.shared_intermediate:
        _shard_gated(state, f"{prefix}shared_expert.", moe.shared_intermediate, shard)


def shard_state(state: dict[str, Weight], cfg: ModelConfig, shard: Shard) -> None:
    """Replace the (fused, see loader._fuse_projections) full tensors of `state` by this rank's shares, in place.
    A tied LM head stays the same object as the embedding."""
    d, h, kv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    lh, lkv = shard.num_heads, shard.num_kv_heads
    q0, k0 = shard.rank * lh * d, shard.first_kv_head * d
    for layer in range(cfg.num_layers):
        p = f"layers.{layer}."
        for kind in ("weight", "bias"):
            name = f"{p}self_attn.qkv_proj.{kind}"
            if name in state:  # [q (h d) | k (kv d) | v (kv d)] → this rank's q heads, then its k and v heads
                w = state[name]
                state[name] = _cat_rows([_rows(w, q0, q0 + lh * d),
                                         _rows(w, h * d + k0, h * d + k0 + lkv * d),
                                         _rows(w, (h + kv) * d + k0, (h + kv) * d + k0 + lkv * d)])
        state[f"{p}self_attn.o_proj.weight"] = _columns(state[f"{p}self_attn.o_proj.weight"], q0, q0 + lh * d)
        if f"{p}self_attn.sinks" in state:  # gpt-oss: a sink per query head
            state[f"{p}self_attn.sinks"] = state[f"{p}self_attn.sinks"][shard.rank * lh:(shard.rank + 1) * lh]
        _first_rank_only(state, f"{p}self_attn.o_proj.bias", shard)
        if f"{p}mlp.gate_up_proj.weight" in state:
            _shard_gated(state, f"{p}mlp.", cfg.intermediate_size, shard)
        else:
            _shard_experts(state, f"{p}mlp.", cfg, shard)
    tied = state["lm_head.weight"] is state["embed_tokens.weight"]
    v0, v1 = shard.vocab_start, shard.vocab_start + shard.vocab_rows
    for name in ("embed_tokens.weight",) if tied else ("embed_tokens.weight", "lm_head.weight"):
        state[name] = _pad_rows(_rows(state[name], v0, min(v1, cfg.vocab_size)), shard.vocab_rows)
    if tied:
        state["lm_head.weight"] = state["embed_tokens.weight"]


def resize_modules(model: nn.Module, cfg: ModelConfig, shard: Shard) -> None:
    """Give the (meta) modules of `model` this rank's shapes and head counts, before its weights are loaded."""
    d, hidden = cfg.head_dim, cfg.hidden_size
    lh, lkv, li = shard.num_heads, shard.num_kv_heads, shard.intermediate
    with torch.device("meta"):
        for block in model.layers:
            attn, mlp = block.self_attn, block.mlp
            attn.qkv_proj = Linear(hidden, (lh + 2 * lkv) * d, bias=cfg.attention_bias)
            attn.o_proj = Linear(lh * d, hidden, bias=cfg.o_proj_bias)
            attn.num_heads, attn.num_kv_heads = lh, lkv
            if cfg.attention_sinks:
                attn.sinks = nn.Parameter(torch.empty(lh), requires_grad=False)
            if isinstance(mlp, MoEMLP):
                _resize_experts(mlp, cfg, shard)
            else:
                _resize_gated(mlp, hidden, li)
        model.embed_tokens = embedding_table(shard.vocab_rows, hidden)
        model.lm_head = Linear(hidden, shard.vocab_rows, bias=False)


def _resize_gated(mlp: nn.Module, hidden: int, width: int) -> None:
    mlp.gate_up_proj = Linear(hidden, 2 * width, bias=False)
    mlp.down_proj = Linear(width, hidden, bias=False)


def _resize_experts(mlp: MoEMLP, cfg: ModelConfig, shard: Shard) -> None:
    moe, hidden = cfg.moe, cfg.hidden_size
    assert moe is not None
    part = moe.expert_intermediate // shard.size
    mlp.experts.gate_up = CheckpointExperts(moe.num_experts, 2 * part, hidden, moe.expert_bias)
    mlp.experts.down = CheckpointExperts(moe.num_experts, hidden, part, moe.expert_bias)
    if moe.shared_intermediate:
        _resize_gated(mlp.shared_expert, hidden, moe.shared_intermediate // shard.size)
