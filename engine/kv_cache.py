"""`PagedKVCache`: one preallocated pool of key/value blocks per layer, addressed by token slots."""
from __future__ import annotations

import torch

from .config import ModelConfig

DEFAULT_BLOCK_SIZE = 16


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of keys and values one token takes across all layers."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * torch.empty((), dtype=dtype).element_size()


class PagedKVCache:
    """Keys and values as [num_blocks * block_size, kv_heads, head_dim] per layer.

    Token slot `b * block_size + i` is position i of block b. The pool is committed up front (zeroed), so the
    process's memory is what it will be under full load from the start, never growing with the requests served.
    """

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (num_blocks * block_size, cfg.num_kv_heads, cfg.head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [N, kv_heads, head_dim] at token `slots` [N]."""
        self.keys[layer].index_copy_(0, slots, k)
        self.values[layer].index_copy_(0, slots, v)

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at `slots` [..., L] as [..., kv_heads, L, head_dim] (the layout attention reads)."""
        shape = (*slots.shape, *self.keys[layer].shape[1:])
        k = self.keys[layer].index_select(0, slots.reshape(-1)).view(shape)
        v = self.values[layer].index_select(0, slots.reshape(-1)).view(shape)
        return k.transpose(-3, -2), v.transpose(-3, -2)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks (source, destination), for copy-on-write."""
        if not pairs:
            return
        bs = self.block_size
        src = torch.cat([torch.arange(s * bs, (s + 1) * bs) for s, _ in pairs]).to(self.keys[0].device)
        dst = torch.cat([torch.arange(d * bs, (d + 1) * bs) for _, d in pairs]).to(self.keys[0].device)
        for store in (self.keys, self.values):
            for t in store:
                t.index_copy_(0, dst, t.index_select(0, src))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)
