"""`DecoderModel`: embedding, a stack of family blocks, final norm and LM head, run over a `ForwardBatch`."""
from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..kv_cache import KVCache
from ..layers import ForwardBatch, RMSNorm, attention_mask, rope_cos_sin, rope_inv_freq


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

    def make_batch(self, slots: list[int], positions: torch.Tensor, dtype: torch.dtype) -> ForwardBatch:
        """Describe a forward pass of len(slots) sequences whose new tokens sit at `positions` [B, T]."""
        kv_len = int(positions.max()) + 1
        b, t = positions.shape
        contiguous = b == 1
        start = int(positions[0, 0]) if contiguous else None
        rope = {"global": rope_cos_sin(self.inv_freq, positions, dtype)}
        if self.local_inv_freq is not None:
            rope["local"] = rope_cos_sin(self.local_inv_freq, positions, dtype)
        # A fresh single sequence attends causally from position 0, and decode of one token sees every key:
        # both are SDPA's fast paths, so no explicit mask is built for them.
        plain = contiguous and (start == 0 or t == 1)
        full_mask = None if plain else attention_mask(positions, kv_len, None)
        window = self.cfg.sliding_window
        sliding_mask = None
        if window is not None and any(self.cfg.layer_is_sliding):
            sliding_mask = None if plain and kv_len <= window else attention_mask(positions, kv_len, window)
        return ForwardBatch(slots, start, positions, kv_len, rope, full_mask, sliding_mask)

    def forward(self, ids: torch.Tensor, batch: ForwardBatch, cache: KVCache,
                logit_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Logits float32 for ids [B, T]: at every position, or only at the flat row indices `logit_rows`."""
        x = self.embed_tokens(ids)
        if self.cfg.embed_scale != 1.0:
            x = x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype)
        for layer in self.layers:
            x = layer(x, batch, cache)
        x = x.reshape(-1, x.shape[-1])
        if logit_rows is not None:
            x = x[logit_rows]
        logits = self.lm_head(self.norm(x)).float()
        if self.cfg.final_logit_softcap:
            cap = self.cfg.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits
