"""Load a GGUF model: config from metadata, tensors dequantized and renamed to the decoder's parameter names.

Mixtures of experts (llama.cpp's `ffn_{gate,up,down}_exps`, 3-D: [experts, out, in]) are not decoded here: each
becomes a `LazyExperts` (engine/weights/lazy_experts.py) that reads one expert at a time from the memory-mapped
file when the loader packs or converts it, so a 4-bit model never holds a dense copy of all its experts.
"""
from __future__ import annotations

import os
import re
from typing import Any

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType as Q

from engine.config import ModelConfig, config_from_gguf
from engine.errors import UnsupportedModelError
from engine.model.quant import Affine4Bit
from engine.model.quant.mxfp4 import Mxfp4Tensor
from engine.weights import Progress, no_progress
from engine.weights.dequant import affine_4bit, dequantize, has_affine_4bit_form
from engine.weights.gguf_format import GGUFFile, TensorEntry, read_gguf_metadata
from engine.weights.lazy_experts import LazyExperts

__all__ = ["GGUFFile", "load_gguf", "read_gguf_metadata", "undo_llama_qk_permute"]

_GLOBAL_NAMES = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
                 "output.weight": "lm_head.weight"}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
    # mixtures of experts: the router, Qwen2-MoE's shared expert and its gate
    "ffn_gate_inp": "mlp.router", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Expert stacks are named as the readers' unfused stacks: `mlp.experts.gate_proj`, its bias `..._bias`.
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")
_IGNORED = {"rope_freqs.weight"}


def undo_llama_qk_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Invert llama.cpp's row permutation of attn_q/attn_k (interleaved → rotate-half RoPE layout)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _param_name(gguf_name: str, family: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.fullmatch(gguf_name)
    if not m:
        return None
    layer, part, kind = m.groups()
    if part in _EXPERT_NAMES:
        return f"layers.{layer}.mlp.experts.{_EXPERT_NAMES[part]}{'_bias' if kind == 'bias' else ''}"
    if part == "attn_sinks":  # gpt-oss: a logit per head, a parameter of its own (no `.weight`)
        return f"layers.{layer}.self_attn.sinks" if kind == "weight" else None
    if part == "ffn_norm":  # the norm before the MLP: llama's post-attention norm, gemma's pre-feedforward norm
        target = "pre_feedforward_layernorm" if family == "gemma3" else "post_attention_layernorm"
    else:
        target = _BLOCK_NAMES.get(part)
    return None if target is None else f"layers.{layer}.{target}.{kind}"


def _lazy_experts(gguf: GGUFFile, entry: TensorEntry, keep_4bit: bool) -> LazyExperts:
    """A 3-D expert tensor [E, out, in] as experts read on demand from the memory map: `Mxfp4Tensor` each for MXFP4,
    `Affine4Bit` each for 4-bit blocks with `keep_4bit`, else float32."""
    count, out_features, in_features = entry.shape
    shape = (out_features, in_features)
    raw = gguf.raw(entry)  # a view of the map: [E, out, bytes per row], nothing read yet
    form = "mxfp4" if entry.ggml_type == Q.MXFP4 else \
        "affine4bit" if keep_4bit and has_affine_4bit_form(entry.ggml_type) else "float"

    def read(e: int) -> torch.Tensor | Affine4Bit | Mxfp4Tensor:
        if form == "mxfp4":
            return Mxfp4Tensor.from_gguf_blocks(torch.from_numpy(np.array(raw[e])), shape)
        if form == "affine4bit":
            w = affine_4bit(raw[e], entry.ggml_type, shape)
            assert w is not None
            return w
        return dequantize(raw[e], entry.ggml_type, shape, f"{entry.name} expert {e}")

    return LazyExperts(count, out_features, in_features, read, form, entry.ggml_type, lambda e: raw[e], entry.name)


def load_gguf(path: str | os.PathLike[str], keep_4bit: bool = False, progress: Progress = no_progress
              ) -> tuple[ModelConfig, dict[str, torch.Tensor | Affine4Bit | LazyExperts], dict[str, Any],
                         torch.Tensor | None]:
    """(config, float32 state dict in the decoder's names, metadata, llama3 rope frequency factors or None).

    With `keep_4bit`, 4-bit matrices (Q4_0, Q4_1, Q4_K) come as exact `Affine4Bit` codes instead of floats.
    Expert stacks come as `LazyExperts`, unread (each expert, when read: an `Affine4Bit` as above, an exact
    `Mxfp4Tensor` for MXFP4 whatever `keep_4bit`, else float32).
    """
    gguf = GGUFFile(path)
    cfg = config_from_gguf(gguf.metadata, has_output_tensor="output.weight" in gguf.tensors,
                           tensor_names=gguf.tensors.keys())
    permuted = gguf.architecture == "llama"  # llama.cpp permutes llama's (and Mixtral's) q/k rows
    state: dict[str, Any] = {}
    total = len(gguf.tensors)
    for done, (name, entry) in enumerate(gguf.tensors.items(), 1):
        progress("reading weights", done, total)
        if name in _IGNORED:
            continue
        param = _param_name(name, cfg.family)
        if param is None:
            raise UnsupportedModelError(f"{gguf.path}: unexpected tensor {name!r} for architecture {cfg.family}")
        if len(entry.shape) == 3:
            if ".mlp.experts." not in param:
                raise UnsupportedModelError(f"{gguf.path}: tensor {name!r} of shape {entry.shape} is not an "
                                            "expert stack")
            state[param] = _lazy_experts(gguf, entry, keep_4bit)
            continue
        w = affine_4bit(gguf.raw(entry), entry.ggml_type, entry.shape) if keep_4bit else None
        if w is None:
            w = dequantize(gguf.raw(entry), entry.ggml_type, entry.shape, name)
        heads = {"q_proj.weight": cfg.num_heads, "k_proj.weight": cfg.num_kv_heads}.get(param.split(".", 3)[-1])
        if permuted and heads is not None:
            unpermute = lambda t: undo_llama_qk_permute(t, heads)  # noqa: E731
            w = w.map_rows(unpermute) if isinstance(w, Affine4Bit) else unpermute(w)
        if param.endswith("shared_expert_gate.weight") and len(entry.shape) == 1:
            w = w.reshape(1, -1)  # llama.cpp's quantizer may store Qwen2-MoE's [1, H] gate as [H]
        state[param] = w
    freq_factors = None
    if "rope_freqs.weight" in gguf.tensors:
        e = gguf.tensors["rope_freqs.weight"]
        freq_factors = dequantize(gguf.raw(e), e.ggml_type, e.shape, e.name)
    return cfg, state, gguf.metadata, freq_factors
