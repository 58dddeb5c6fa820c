"""Mixture-of-experts tensors of Hugging Face checkpoints in the decoder's names: the router, and every expert's
projection stacked along a leading expert dimension, one stack per projection (gate, up, down).

Checkpoints store experts three ways: one tensor per expert and projection (Qwen-MoE, OLMoE:
`mlp.experts.E.gate_proj.weight`; Mixtral: `block_sparse_moe.experts.E.w1/w3/w2`), stacked and concatenated
(transformers' fused form: `mlp.experts.gate_up_proj` [E, 2I, H]), or gpt-oss's own stacks, transposed with gate
and up interleaved column by column (`mlp.experts.gate_up_proj` [E, H, 2I], biases beside them), or as published,
in MXFP4 (`*_blocks` [E, out, in/32, 16] and `*_scales`, rows not transposed, kept 4-bit: `Mxfp4Tensor`). The stacks named
here (`mlp.experts.{gate,up,down}_proj` [E, out, in] and `..._bias` [E, out]) are what the loader fuses into the
decoder's `experts.gate_up` and `experts.down` (engine/loader/build.py).
"""
from __future__ import annotations

import re
from typing import Any

import torch

from engine.config import ModelConfig
from engine.errors import ModelFormatError
from engine.model.quant.mxfp4 import Mxfp4Tensor

_PER_EXPERT = re.compile(r"layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
_ROUTER = re.compile(r"layers\.(\d+)\.(?:mlp\.gate|block_sparse_moe\.gate|mlp\.router)\.(weight|bias)")
_STACKED = re.compile(r"layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?")
_MXFP4 = re.compile(r"layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)_(blocks|scales)")
_PROJECTIONS = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj",
                "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def stack_experts(state: dict[str, Any], cfg: ModelConfig) -> None:
    """Rename the routers and stack the experts of `state` in place (each expert's tensors are popped as they are
    stacked, so no more than one layer's projection is held twice)."""
    moe = cfg.moe
    if moe is None:
        return
    per_expert: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    mxfp4: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name in list(state):
        if m := _ROUTER.fullmatch(name):
            state[f"layers.{m[1]}.mlp.router.{m[2]}"] = state.pop(name)
        elif m := _PER_EXPERT.fullmatch(name):
            if m[3] not in _PROJECTIONS:
                raise ModelFormatError(f"unexpected expert tensor {name!r}")
            per_expert.setdefault((int(m[1]), _PROJECTIONS[m[3]]), {})[int(m[2])] = state.pop(name)
        elif m := _STACKED.fullmatch(name):
            _split_stacked(state, int(m[1]), m[2], bool(m[3]), state.pop(name), cfg.family == "gpt_oss")
        elif m := _MXFP4.fullmatch(name):
            mxfp4.setdefault((int(m[1]), m[2]), {})[m[3]] = state.pop(name)
    for (layer, kind), parts in mxfp4.items():
        if set(parts) != {"blocks", "scales"}:
            raise ModelFormatError(f"layer {layer} {kind}: MXFP4 {', '.join(parts)} without its pair")
        _split_stacked(state, layer, kind, False, Mxfp4Tensor.from_safetensors_blocks(parts["blocks"], parts["scales"]),
                       cfg.family == "gpt_oss", rows_first=True)
    for (layer, projection), experts in per_expert.items():
        if sorted(experts) != list(range(moe.num_experts)):
            raise ModelFormatError(f"layer {layer} {projection}: {len(experts)} of {moe.num_experts} experts found")
        state[f"layers.{layer}.mlp.experts.{projection}"] = torch.stack([experts.pop(e) for e in range(len(experts))])


def _split_stacked(state: dict[str, Any], layer: int, kind: str, bias: bool, tensor: Any, gpt_oss: bool,
                   rows_first: bool = False) -> None:
    """One stacked tensor: gpt-oss's ([E, H, 2I] interleaved gate/up; [E, I, H] down; biases [E, 2I], [E, H]; its
    MXFP4 blocks already [E, out, in], `rows_first`) or transformers' fused ([E, 2I, H] gate then up; [E, H, I])."""
    prefix, suffix = f"layers.{layer}.mlp.experts.", "_bias" if bias else ""
    transposed = gpt_oss and not bias and not rows_first
    if kind == "down_proj":
        state[f"{prefix}down_proj{suffix}"] = tensor.transpose(1, 2).contiguous() if transposed else tensor
        return
    if isinstance(tensor, Mxfp4Tensor):  # gpt-oss's gate and up rows alternate
        gate, up = tensor.rows(slice(0, None, 2)), tensor.rows(slice(1, None, 2))
    elif gpt_oss:
        rows = tensor.transpose(1, 2) if transposed else tensor  # [E, 2I(, H)], gate and up alternating
        gate, up = rows[:, 0::2], rows[:, 1::2]
    else:
        gate, up = tensor.chunk(2, dim=1)
    state[f"{prefix}gate_proj{suffix}"] = gate.contiguous()
    state[f"{prefix}up_proj{suffix}"] = up.contiguous()
