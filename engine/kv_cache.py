"""`PagedKVCache`: one preallocated pool of key/value blocks per layer, addressed by token slots."""
from __future__ import annotations

import torch

from .config import ModelConfig

DEFAULT_BLOCK_SIZE = 16


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of keys and values one token takes across all layers."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * torch.empty((), dtype=dtype).element_size()


class PagedKVCache:
    """Keys and values as [kv_heads, num_blocks * block_size, head_dim] per layer.

    Token slot `b * block_size + i` is position i of block b. Head-major, so a gather of one sequence's keys is
    already the [kv_heads, L, head_dim] layout attention multiplies with. The pool is reserved up front but not
    touched: pages become resident as blocks are first written (only written slots are ever read).
    """

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (cfg.num_kv_heads, num_blocks * block_size, cfg.head_dim)
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [N, kv_heads, head_dim] at token `slots` [N]."""
        self.keys[layer].index_copy_(1, slots, k.transpose(0, 1))
        self.values[layer].index_copy_(1, slots, v.transpose(0, 1))

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at `slots` [L] or [B, L] as contiguous [kv_heads, L, head_dim] or [B, kv_heads, L, head_dim]."""
        k = self.keys[layer].index_select(1, slots.reshape(-1))
        v = self.values[layer].index_select(1, slots.reshape(-1))
        if slots.dim() == 1:
            return k, v
        b, length = slots.shape
        heads, dim = k.shape[0], k.shape[2]
        if b == 1:
            return k.view(1, heads, length, dim), v.view(1, heads, length, dim)
        return (k.view(heads, b, length, dim).transpose(0, 1).contiguous(),
                v.view(heads, b, length, dim).transpose(0, 1).contiguous())

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
