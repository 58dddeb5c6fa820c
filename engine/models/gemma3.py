"""The gemma3 decoder block: sandwich norms around attention and MLP, q/k norms, GeGLU, sliding/global layers."""
# No `from __future__ import annotations`: the block is compiled by TorchScript (engine/layers.py).
from torch import Tensor, nn

from ..batch import ForwardBatch
from ..config import ModelConfig
from ..layers import Attention, GatedMLP, RMSNorm, RopeTables


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

    def forward(self, x: Tensor, batch: ForwardBatch, rope: RopeTables, keys: Tensor, values: Tensor) -> Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), batch, rope, keys, values))
        mlp = self.mlp(self.pre_feedforward_layernorm(x), batch.packed_rows, batch.deterministic)
        return x + self.post_feedforward_layernorm(mlp)
