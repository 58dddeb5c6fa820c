"""The gemma3 decoder block: sandwich norms around attention and MLP, q/k norms, GeGLU, sliding/global layers."""
from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..batch import ForwardBatch
from ..kv_cache import PagedKVCache
from ..layers import Attention, GatedMLP, RMSNorm


class Gemma3Block(nn.Module):
    """x + post_norm(attn(pre_norm(x))), then x + post_ffw_norm(mlp(pre_ffw_norm(x)))."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = GatedMLP(cfg)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: PagedKVCache) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), batch, cache))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
