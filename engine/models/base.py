"""`DecoderModel`: embedding, a stack of family blocks, final norm and LM head, run over a flat `ForwardBatch`."""
from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..batch import ForwardBatch
from ..kv_cache import PagedKVCache
from ..layers import RMSNorm, rope_cos_sin, rope_inv_freq
from ..quant import intra_op_threads, packed_rows


class DecoderModel(nn.Module):
    """A decoder-only transformer; `block_cls(cfg, layer)` supplies the family's layer."""

    def __init__(self, cfg: ModelConfig, block_cls: type[nn.Module]) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(block_cls(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg.rope, cfg.head_dim), persistent=False)
        local = rope_inv_freq(cfg.local_rope, cfg.head_dim) if cfg.local_rope else None
        self.register_buffer("local_inv_freq", local, persistent=False)
        # Intra-op threads for the output projection and the packed matmuls of batched decoding (None: as the
        # rest). Big matmuls gain from every core even when the small ops around them run on fewer (see
        # Runner.decode_threads and quant.PARALLEL_MATMUL_ROWS).
        self.wide_threads: int | None = None

    def add_rope(self, batch: ForwardBatch, dtype: torch.dtype) -> None:
        """cos/sin of the batch's positions for each rope kind its layers use."""
        batch.rope["global"] = rope_cos_sin(self.inv_freq, batch.positions, dtype)
        if self.local_inv_freq is not None:
            batch.rope["local"] = rope_cos_sin(self.local_inv_freq, batch.positions, dtype)

    def _output_projection(self, x: torch.Tensor) -> torch.Tensor:
        with intra_op_threads(self.wide_threads):
            return self.lm_head(x)

    def forward(self, batch: ForwardBatch, cache: PagedKVCache) -> torch.Tensor:
        """Float32 logits [R, vocab] at the batch's `logit_index` positions."""
        x = self.embed_tokens(batch.ids)
        if self.cfg.embed_scale != 1.0:
            x = x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype)
        with packed_rows(batch.decode.size if batch.decode is not None else 0, self.wide_threads):
            for layer in self.layers:
                x = layer(x, batch, cache)
        x = self.norm(x.index_select(0, batch.logit_index))
        logits = self._output_projection(x).float()
        if self.cfg.final_logit_softcap:
            cap = self.cfg.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits
