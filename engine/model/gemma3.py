"""The gemma3 decoder block: sandwich norms around attention and MLP, q/k norms, GeGLU, sliding/global layers."""
# No `from __future__ import annotations`: the block is compiled by TorchScript (engine/model/layers.py).
from typing import Optional, Tuple

from torch import Tensor, nn

from engine.model.batch import ForwardBatch
from engine.config import ModelConfig
from engine.kernels.fused import add_rms_norm, norm_add_rms_norm
from engine.model.layers import Attention, GatedMLP, RMSNorm, RopeTables


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

    def forward(self, hidden: Tensor, residual: Optional[Tensor], batch: ForwardBatch, rope: RopeTables,
                keys: Tensor, values: Tensor) -> Tuple[Tensor, Tensor]:
        """(the post-normed MLP output, the residual stream after attention); `hidden` is the previous block's
        post-normed MLP output (or the embeddings, with `residual` None), added to the residual here."""
        n_in, n_attn, n_ffw = self.input_layernorm, self.post_attention_layernorm, self.pre_feedforward_layernorm
        normed, residual = add_rms_norm(hidden, residual, n_in.weight, n_in.eps, n_in.doubled)
        attn = self.self_attn(normed, batch, rope, keys, values)
        normed, residual = norm_add_rms_norm(attn, residual, n_attn.weight, n_ffw.weight, n_attn.eps, n_attn.doubled,
                                             n_ffw.doubled)
        mlp = self.mlp(normed, batch.packed_rows, batch.deterministic)
        return self.post_feedforward_layernorm(mlp), residual
