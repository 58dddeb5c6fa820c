"""Load a GGUF model: config from metadata, tensors dequantized and renamed to the decoder's parameter names."""
from __future__ import annotations

import os
import re
from typing import Any

import torch

from engine.config import ModelConfig, config_from_gguf
from engine.errors import UnsupportedModelError
from engine.model.quant import Affine4Bit
from engine.weights import Progress, no_progress
from engine.weights.dequant import affine_4bit, dequantize
from engine.weights.gguf_format import GGUFFile, read_gguf_metadata

__all__ = ["GGUFFile", "load_gguf", "read_gguf_metadata", "undo_llama_qk_permute"]

_GLOBAL_NAMES = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
                 "output.weight": "lm_head.weight"}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
}
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
    if part == "ffn_norm":  # the norm before the MLP: llama's post-attention norm, gemma's pre-feedforward norm
        target = "pre_feedforward_layernorm" if family == "gemma3" else "post_attention_layernorm"
    else:
        target = _BLOCK_NAMES.get(part)
    return None if target is None else f"layers.{layer}.{target}.{kind}"


def load_gguf(path: str | os.PathLike[str], keep_4bit: bool = False, progress: Progress = no_progress
              ) -> tuple[ModelConfig, dict[str, torch.Tensor | Affine4Bit], dict[str, Any], torch.Tensor | None]:
    """(config, float32 state dict in the decoder's names, metadata, llama3 rope frequency factors or None).

    With `keep_4bit`, 4-bit matrices (Q4_0, Q4_1, Q4_K) come as exact `Affine4Bit` codes instead of floats.
    """
    gguf = GGUFFile(path)
    cfg = config_from_gguf(gguf.metadata, has_output_tensor="output.weight" in gguf.tensors)
    state: dict[str, torch.Tensor] = {}
    total = len(gguf.tensors)
    for done, (name, entry) in enumerate(gguf.tensors.items(), 1):
        progress("reading weights", done, total)
        if name in _IGNORED:
            continue
        param = _param_name(name, cfg.family)
        if param is None:
            raise UnsupportedModelError(f"{gguf.path}: unexpected tensor {name!r} for architecture {cfg.family}")
        w = affine_4bit(gguf.raw(entry), entry.ggml_type, entry.shape) if keep_4bit else None
        if w is None:
            w = dequantize(gguf.raw(entry), entry.ggml_type, entry.shape, name)
        heads = {"q_proj.weight": cfg.num_heads, "k_proj.weight": cfg.num_kv_heads}.get(param.split(".", 3)[-1])
        if cfg.family == "llama" and heads is not None:
            unpermute = lambda t: undo_llama_qk_permute(t, heads)  # noqa: E731
            w = w.map_rows(unpermute) if isinstance(w, Affine4Bit) else unpermute(w)
        state[param] = w
    freq_factors = None
    if "rope_freqs.weight" in gguf.tensors:
        e = gguf.tensors["rope_freqs.weight"]
        freq_factors = dequantize(gguf.raw(e), e.ggml_type, e.shape, e.name)
    return cfg, state, gguf.metadata, freq_factors
