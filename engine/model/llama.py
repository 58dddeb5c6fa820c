"""The llama decoder block, which also covers qwen2 (q/k/v biases), qwen3 (q/k norms) and the mixture-of-experts
families (qwen3_moe, qwen2_moe, mixtral, olmoe, gpt_oss: an MoE MLP, and gpt-oss's sinks and biases) through config
flags."""
# No `from __future__ import annotations`: the block is compiled by TorchScript (engine/model/layers.py).
from typing import Optional, Tuple

from torch import Tensor, nn

from engine.model.batch import ForwardBatch
from engine.config import ModelConfig
from engine.kernels.fused import add_rms_norm
from engine.model.layers import Attention, RMSNorm, RopeTables
from engine.model.moe import build_mlp


class LlamaBlock(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)) (the last add in the next block)."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = build_mlp(cfg, layer)

    def forward(self, hidden: Tensor, residual: Optional[Tensor], batch: ForwardBatch, rope: RopeTables,
                keys: Tensor, values: Tensor) -> Tuple[Tensor, Tensor]:
        """(the MLP's output, the residual stream after attention); `hidden` is the previous block's MLP output
        (or the embeddings, with `residual` None), added to the residual here: x + attn(norm(x)), then
        x + mlp(norm(x)) as the next block (or the final norm) adds it."""
        n1, n2 = self.input_layernorm, self.post_attention_layernorm
        normed, residual = add_rms_norm(hidden, residual, n1.weight, n1.eps, n1.doubled)
        attn = self.self_attn(normed, batch, rope, keys, values)
        normed, residual = add_rms_norm(attn, residual, n2.weight, n2.eps, n2.doubled)
        return self.mlp(normed, batch.packed_rows, batch.deterministic), residual
