"""The llama decoder block, which also covers qwen2 (q/k/v biases) and qwen3 (q/k norms) through config flags."""
# No `from __future__ import annotations`: the block is compiled by TorchScript (engine/layers.py).
from torch import Tensor, nn

from ..batch import ForwardBatch
from ..config import ModelConfig
from ..layers import Attention, GatedMLP, RMSNorm, RopeTables


class LlamaBlock(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = GatedMLP(cfg)

    def forward(self, x: Tensor, batch: ForwardBatch, rope: RopeTables, keys: Tensor, values: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), batch, rope, keys, values)
        return x + self.mlp(self.post_attention_layernorm(x), batch.packed_rows, batch.deterministic)
