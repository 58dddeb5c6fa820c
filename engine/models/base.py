"""`DecoderModel`: embedding, a stack of family blocks, final norm and LM head, run over a flat `ForwardBatch`."""
from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..batch import ForwardBatch
from ..kv_cache import PagedKVCache
from ..layers import RMSNorm, rope_cos_sin, rope_inv_freq
from ..quant import packed_rows
from ..scripted_decode import script_decoder


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
        # Pure decode steps on CPU run the layers as one TorchScript call (engine/scripted_decode.py), built on the
        # first such step; False keeps every step on the eager modules.
        self.script_decode = True
        self.__dict__["_scripted"] = None  # not a submodule: it shares the layers' tensors

    def add_rope(self, batch: ForwardBatch, dtype: torch.dtype) -> None:
        """cos/sin of the batch's positions for each rope kind its layers use."""
        batch.rope["global"] = rope_cos_sin(self.inv_freq, batch.positions, dtype)
        if self.local_inv_freq is not None:
            batch.rope["local"] = rope_cos_sin(self.local_inv_freq, batch.positions, dtype)

    def _scripted_layers(self) -> torch.jit.ScriptModule | None:
        """The scripted decode layers, built on first use (None: off, or this model has no scripted form)."""
        if not self.script_decode:
            return None
        if self._scripted is None:
            self.__dict__["_scripted"] = script_decoder(self.layers) or False
        return self._scripted or None

    def _scripted_step(self, scripted: torch.jit.ScriptModule, x: torch.Tensor, batch: ForwardBatch,
                       cache: PagedKVCache) -> torch.Tensor:
        group = batch.decode
        first, length = group.key_span if group.key_span is not None else (0, 0)
        cos, sin = batch.rope["global"]
        local_cos, local_sin = batch.rope.get("local", (cos, sin))
        # Unoptimized execution: the same speed here, without the profiling executor's re-optimizing runs (0.6-0.9 s
        # each) on the first calls.
        with torch.jit.optimized_execution(False):
            return scripted(x, cos, sin, local_cos, local_sin, batch.slots, cache.keys, cache.values, first, length,
                            group.key_blocks, group.full_mask, group.sliding_mask, cache.block_size)

    def forward(self, batch: ForwardBatch, cache: PagedKVCache) -> torch.Tensor:
        """Float32 logits [R, vocab] at the batch's `logit_index` positions."""
        x = self.embed_tokens(batch.ids)
        if self.cfg.embed_scale != 1.0:
            x = x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype)
        decode = batch.decode
        scripted = None
        if decode is not None and not batch.prefills and x.is_cpu:
            scripted = self._scripted_layers()
        if scripted is not None:
            x = self._scripted_step(scripted, x, batch, cache)
        else:
            with packed_rows(batch.packed_tokens):
                for layer in self.layers:
                    x = layer(x, batch, cache)
        x = self.norm(x.index_select(0, batch.logit_index))
        logits = self.lm_head(x).float()
        if self.cfg.final_logit_softcap:
            cap = self.cfg.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits
