"""`PagedKVCache`: one preallocated pool of key/value blocks per layer, addressed by token slots."""
from __future__ import annotations

from typing import Tuple

import torch

from engine.config import ModelConfig

DEFAULT_BLOCK_SIZE = 16


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype, kv_heads: int | None = None) -> int:
    """Bytes of keys and values one token takes across all layers (of `kv_heads` heads: default the model's)."""
    heads = cfg.num_kv_heads if kv_heads is None else kv_heads
    return 2 * cfg.num_layers * heads * cfg.head_dim * torch.empty((), dtype=dtype).element_size()


def gather_blocks(store: torch.Tensor, blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """The slots of whole `blocks` [n] or [B, n] of one layer's `store` [kv_heads, slots, head_dim], as contiguous
    [kv_heads, n * block_size, head_dim] or [B, kv_heads, n * block_size, head_dim]; slots past a sequence's length
    are for the caller to mask."""
    heads, dim = store.shape[0], store.shape[2]
    picked = store.view(heads, -1, block_size * dim).index_select(1, blocks.reshape(-1))
    if blocks.dim() == 1:
        return picked.view(heads, -1, dim)
    b, n = blocks.shape[0], blocks.shape[1]
    if b == 1:
        return picked.view(1, heads, n * block_size, dim)
    return picked.view(heads, b, n * block_size, dim).transpose(0, 1).contiguous()


def write_slots(keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> None:
    """Store k, v [N, kv_heads, head_dim] at token `slots` [N] of one layer's stores [kv_heads, slots, head_dim]."""
    keys.index_copy_(1, slots, k.transpose(0, 1))
    values.index_copy_(1, slots, v.transpose(0, 1))


def window_span(first: int, length: int, window: int) -> Tuple[int, int]:
    """The part of slots [first, first + length) a sliding window of `window` keys sees (0: no window)."""
    if 0 < window < length:
        return first + length - window, window
    return first, length


class PagedKVCache:
    """Keys and values as [kv_heads, num_blocks * block_size, head_dim] per layer.

    Token slot `b * block_size + i` is position i of block b. Head-major, so a gather of one sequence's keys is
    already the [kv_heads, L, head_dim] layout attention multiplies with. The pool is committed up front (zeroed),
    so the process's memory is what it will be under full load from the start, never growing with the requests.
    """

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, kv_heads: int | None = None) -> None:
        """`kv_heads`: the heads this process holds (a tensor-parallel rank's share); default the model's."""
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (cfg.num_kv_heads if kv_heads is None else kv_heads, num_blocks * block_size, cfg.head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [N, kv_heads, head_dim] at token `slots` [N]."""
        write_slots(self.keys[layer], self.values[layer], slots, k, v)

    def gather(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of whole `blocks` [n] or [B, n]: see `gather_blocks`."""
        return (gather_blocks(self.keys[layer], blocks, self.block_size),
                gather_blocks(self.values[layer], blocks, self.block_size))

    def span(self, layer: int, first: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of slots [first, first + length) as [1, kv_heads, length, head_dim] views (no copy)."""
        return (self.keys[layer][:, first:first + length].unsqueeze(0),
                self.values[layer][:, first:first + length].unsqueeze(0))

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks (source, destination), for copy-on-write."""
        if not pairs:
            return
        bs = self.block_size
        src = torch.cat([torch.arange(s * bs, (s + 1) * bs) for s, _ in pairs]).to(self.keys[0].device)
        dst = torch.cat([torch.arange(d * bs, (d + 1) * bs) for _, d in pairs]).to(self.keys[0].device)
        for store in (self.keys, self.values):
            for t in store:
                t.index_copy_(1, dst, t.index_select(1, src))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)
