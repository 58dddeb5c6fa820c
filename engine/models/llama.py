"""The llama decoder block, which also covers qwen2 (q/k/v biases) and qwen3 (q/k norms) through config flags."""
from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..batch import ForwardBatch
from ..kv_cache import PagedKVCache
from ..layers import Attention, GatedMLP, RMSNorm


class LlamaBlock(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = GatedMLP(cfg)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: PagedKVCache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), batch, cache)
        return x + self.mlp(self.post_attention_layernorm(x))
