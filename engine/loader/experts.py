"""`place_experts`: the expert stacks a mixture-of-experts model serves with, built from the checkpoint's.

The model is built with `CheckpointExperts` (float parameters, on the meta device); the readers give each projection
as a float stack, a stacked `Affine4Bit` or `Mxfp4Tensor`, or the GGUF reader's `LazyExperts` (read an expert at a
time). Here each becomes, packed one expert at a time so that no dense copy of every expert is ever held:

- on CPU, the form `expert_stack` picks (engine/model/quant/experts.py): MXFP4 stays MXFP4; in int4 mode 4-bit
  sources stay exact and float ones are quantized (a GGUF's wider types become int8, as its linears do); in mode
  none, float in the compute dtype;
- on CUDA, a `KernelExperts` in the fused kernel's formats (engine/kernels/moe.py): MXFP4 as it is, int4 codes
  when `--quant int4` is asked for, else bfloat16.
"""
from __future__ import annotations

from typing import Any

import torch

from engine.model.moe import KernelExperts, MoEMLP
from engine.model.quant import Affine4Bit, quantize_4bit
from engine.model.quant.experts import ExpertStack, dense_expert, expert_stack, per_expert
from engine.model.quant.mxfp4 import Mxfp4Tensor


def place_experts(model: torch.nn.Module, state: dict[str, Any], quant: str, dtype: torch.dtype,
                  device: torch.device, requantize_floats: bool) -> None:
    """Swap every MoE layer's `CheckpointExperts` for its serving stack, taking their tensors out of `state`."""
    for i, block in enumerate(model.layers):
        mlp = block.mlp
        if not isinstance(mlp, MoEMLP):
            continue
        for name in ("gate_up", "down"):
            prefix = f"layers.{i}.mlp.experts.{name}."
            source, bias = state.pop(prefix + "weight"), state.pop(prefix + "bias", None)
            if getattr(source, "form", None) == "mxfp4":  # a GGUF's MXFP4 experts: stacked as they are, 4 bits
                source = source.stacked()
            if bias is not None:
                bias = dense_expert(bias).to(device)
            if device.type == "cuda":
                stack: ExpertStack = KernelExperts(_kernel_weights(source, quant, dtype, device), bias, dtype)
            else:
                four_bit = isinstance(source, Affine4Bit) or bool(getattr(source, "four_bit", False))
                mode = quant if requantize_floats or four_bit or quant == "none" else "int8"
                stack = expert_stack(source, bias, mode, dtype, in_features=source.shape[-1])
            setattr(mlp.experts, name, stack)


def _kernel_weights(source: Any, quant: str, dtype: torch.dtype, device: torch.device) -> Any:
    from engine.kernels import moe as kernels

    if isinstance(source, Mxfp4Tensor):
        return kernels.mxfp4(source.blocks.to(device), source.scales.to(device))
    e, out_f, in_f = source.shape
    if quant == "int4":
        codes = torch.empty((e, out_f, in_f // 2), dtype=torch.uint8, device=device)
        scales = torch.empty((e, out_f, in_f // kernels.GROUP), dtype=dtype, device=device)
        offsets = torch.empty_like(scales)
        for i, w in enumerate(per_expert(source, None)[0]):
            four = w if isinstance(w, Affine4Bit) else quantize_4bit(dense_expert(w))
            codes[i] = kernels.pack_nibbles(four.codes.to(device))
            scales[i], offsets[i] = four.scale.to(device), four.offset.to(device)
        return kernels.int4(codes, scales, offsets)
    weight = torch.empty((e, out_f, in_f), dtype=dtype, device=device)
    for i, w in enumerate(per_expert(source, None)[0]):
        weight[i] = dense_expert(w).to(device=device, dtype=dtype)
    return kernels.dense(weight)
