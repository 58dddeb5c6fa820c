"""`BertEncoder`: the BERT family of encoders (all-MiniLM, bge, e5, ...) over a batch of packed sentences.

Sentences travel packed: the real tokens of every sentence form one [N, hidden] sequence through the embeddings,
projections, MLPs and norms, so no work is spent on padding there (the bulk of it). Only attention sees a padded
[B, heads, T, head_dim] layout, full (bidirectional) within each sentence, with each sentence's padding keys masked
out; its padded query rows are computed and dropped. Layers are post-norm: x = norm(x + attn(x)), then
x = norm(x + mlp(x)), as in BERT.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.config import EncoderConfig
from engine.errors import ModelFormatError
from engine.model.layers import embedding_table


class PackedSentences(NamedTuple):
    """The sentences of one encoder call: their tokens one after the other, and the padded layout of attention."""

    ids: Tensor                # [N] the tokens of every sentence
    positions: Tensor          # [N] each token's position within its sentence
    lengths: list[int]         # tokens of each sentence
    pad_index: Tensor | None   # [N] each token's row in the padded [B * T] layout; None: all of length T
    key_mask: Tensor | None    # [B, 1, 1, T] bool, True for real keys; None: all of length T
    longest: int               # T


def pack_sentences(inputs: Sequence[Sequence[int]], device: torch.device) -> PackedSentences:
    """Lay out the sentences (token ids, each non-empty) for one `BertEncoder` call."""
    lengths = [len(ids) for ids in inputs]
    longest = max(lengths)
    flat = [t for ids in inputs for t in ids]
    positions = [p for n in lengths for p in range(n)]
    pad_index = key_mask = None
    if min(lengths) != longest:
        pad_index = torch.tensor([b * longest + p for b, n in enumerate(lengths) for p in range(n)], device=device)
        lens = torch.tensor(lengths, device=device)
        key_mask = (torch.arange(longest, device=device) < lens.unsqueeze(1)).view(len(lengths), 1, 1, longest)
    return PackedSentences(torch.tensor(flat, dtype=torch.long, device=device),
                           torch.tensor(positions, dtype=torch.long, device=device), lengths, pad_index, key_mask,
                           longest)


class BertLayer(nn.Module):
    """Self-attention (q, k, v in one projection) and a GELU MLP, each followed by a residual LayerNorm."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv_proj = nn.Linear(h, 3 * h)
        self.o_proj = nn.Linear(h, h)
        self.attention_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.up_proj = nn.Linear(h, cfg.intermediate_size)
        self.down_proj = nn.Linear(cfg.intermediate_size, h)
        self.output_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.gelu_approximate = "tanh" if cfg.hidden_act == "gelu_tanh" else "none"

    def attention(self, x: Tensor, batch: PackedSentences, padded: Tensor | None) -> Tensor:
        """x [N, hidden] → [N, hidden]: every token attends to every token of its own sentence. `padded`: a
        [B * T, 3 * hidden] buffer whose padding rows are zeros (None when there is no padding)."""
        b, t, h, d = len(batch.lengths), batch.longest, self.num_heads, self.head_dim
        qkv = self.qkv_proj(x.to(self.matmul_dtype)).to(x.dtype)
        if padded is not None:  # only the real rows are written: the padding stays zeros, finite keys and values
            qkv = padded.index_copy_(0, batch.pad_index, qkv)
        q, k, v = qkv.view(b, t, 3, h, d).permute(2, 0, 3, 1, 4).unbind(0)  # each [B, heads, T, d]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=batch.key_mask)
        out = out.transpose(1, 2).reshape(b * t, h * d)
        if batch.pad_index is not None:
            out = out.index_select(0, batch.pad_index)
        return self.o_proj(out.to(self.matmul_dtype)).to(x.dtype)

    def forward(self, x: Tensor, batch: PackedSentences, padded: Tensor | None = None) -> Tensor:
        x = self.attention_norm(x + self.attention(x, batch, padded))
        up = self.up_proj(x.to(self.matmul_dtype))
        mlp = self.down_proj(F.gelu(up, approximate=self.gelu_approximate)).to(x.dtype)
        return self.output_norm(x + mlp)

    @property
    def matmul_dtype(self) -> torch.dtype:
        return self.qkv_proj.weight.dtype


class BertEncoder(nn.Module):
    """Token, position and (type 0) token-type embeddings, a LayerNorm, then the layers; no pooler head."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.embed_tokens = embedding_table(cfg.vocab_size, h)
        self.embed_positions = embedding_table(cfg.max_position, h)
        self.embed_types = embedding_table(cfg.type_vocab_size, h)
        self.embed_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_layers))

    def forward(self, batch: PackedSentences) -> Tensor:
        """The last hidden states [N, hidden] of every token of the batch, in its packed order."""
        # Every token is of type 0: one sentence per input (pairs are for cross-encoders).
        x = self.embed_tokens(batch.ids) + self.embed_positions(batch.positions) + self.embed_types.weight[0]
        x = self.embed_norm(x)
        padded = None
        if batch.pad_index is not None:  # one buffer for every layer's padded q, k, v
            padded = x.new_zeros(len(batch.lengths) * batch.longest, 3 * self.cfg.hidden_size)
        for layer in self.layers:
            x = layer(x, batch, padded)
        return x


_LAYER_NAMES = {
    "attention.output.dense": "o_proj", "attention.output.LayerNorm": "attention_norm",
    "intermediate.dense": "up_proj", "output.dense": "down_proj", "output.LayerNorm": "output_norm",
}
_EMBEDDING_NAMES = {
    "embeddings.word_embeddings": "embed_tokens", "embeddings.position_embeddings": "embed_positions",
    "embeddings.token_type_embeddings": "embed_types", "embeddings.LayerNorm": "embed_norm",
}


def bert_state_dict(hf: dict[str, Tensor], cfg: EncoderConfig) -> dict[str, Tensor]:
    """A Hugging Face BertModel's tensors (prefix and heads already stripped) in `BertEncoder`'s names, with each
    layer's query, key and value projections concatenated into one."""
    state: dict[str, Tensor] = {}
    # Checkpoints from before transformers 2 name LayerNorm parameters gamma and beta.
    hf = {name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias"): t
          for name, t in hf.items()}
    for old, new in _EMBEDDING_NAMES.items():
        for kind in ("weight", "bias"):
            if f"{old}.{kind}" in hf:
                state[f"{new}.{kind}"] = hf.pop(f"{old}.{kind}")
    for i in range(cfg.num_layers):
        prefix = f"encoder.layer.{i}."
        for kind in ("weight", "bias"):
            parts = [f"{prefix}attention.self.{p}.{kind}" for p in ("query", "key", "value")]
            if all(p in hf for p in parts):
                state[f"layers.{i}.qkv_proj.{kind}"] = torch.cat([hf.pop(p) for p in parts])
            for old, new in _LAYER_NAMES.items():
                if f"{prefix}{old}.{kind}" in hf:
                    state[f"layers.{i}.{new}.{kind}"] = hf.pop(f"{prefix}{old}.{kind}")
    if hf:
        raise ModelFormatError(f"unexpected tensors for a bert encoder: {sorted(hf)[:5]}")
    return state
