"""`KVCache`: per-layer key/value storage for many sequences at once, one slot per sequence."""
from __future__ import annotations

import torch

GROW_CHUNK = 256


class KVCache:
    """Keys and values as [slots, kv_heads, capacity, head_dim] per layer; capacity grows in chunks up to `max_len`.

    Every sequence owns one slot and writes its tokens at their absolute positions, so a batch of sequences of
    different lengths shares one tensor per layer and one forward pass.
    """

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.num_layers, self.num_slots, self.max_len = num_layers, num_slots, max_len
        self._shape = (num_slots, num_kv_heads, 0, head_dim)
        self.dtype, self.device = dtype, device
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.capacity = 0

    def ensure_capacity(self, length: int) -> None:
        """Make room for positions [0, length) in every slot, copying what is stored when growing."""
        if length <= self.capacity:
            return
        new_cap = min(self.max_len, max(length, (self.capacity * 2) or GROW_CHUNK))
        new_cap = max(new_cap, length)
        s, h, _, d = self._shape
        for store in (self.keys, self.values):
            for i in range(self.num_layers):
                grown = torch.zeros((s, h, new_cap, d), dtype=self.dtype, device=self.device)
                if self.capacity:
                    grown[:, :, :self.capacity] = store[i]
                    store[i] = grown
                else:
                    store.append(grown)
        self.capacity = new_cap

    def write_and_read(self, layer: int, slots: list[int], start: int | None, positions: torch.Tensor,
                       k: torch.Tensor, v: torch.Tensor, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, T, H, D] at `positions` [B, T] of each slot; return keys, values [B, H, kv_len, D].

        `start` is the first position when the batch is one sequence written contiguously (a cheap view path).
        """
        kc, vc = self.keys[layer], self.values[layer]
        if start is not None:
            s, t = slots[0], k.shape[1]
            kc[s, :, start:start + t] = k[0].transpose(0, 1)
            vc[s, :, start:start + t] = v[0].transpose(0, 1)
            return kc[s:s + 1, :, :kv_len], vc[s:s + 1, :, :kv_len]
        slot_idx = torch.tensor(slots, device=kc.device).unsqueeze(1).expand_as(positions)
        kc[slot_idx, :, positions] = k
        vc[slot_idx, :, positions] = v
        rows = torch.tensor(slots, device=kc.device)
        return kc[rows, :, :kv_len], vc[rows, :, :kv_len]

    def export_slot(self, slot: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of the first `length` positions of a slot, per layer."""
        return [(k[slot, :, :length].clone(), v[slot, :, :length].clone()) for k, v in zip(self.keys, self.values)]

    def import_slot(self, slot: int, layers: list[tuple[torch.Tensor, torch.Tensor]], length: int) -> None:
        """Write the first `length` positions of saved per-layer tensors into a slot."""
        self.ensure_capacity(length)
        for (k, v), kc, vc in zip(layers, self.keys, self.values):
            kc[slot, :, :length] = k[:, :length]
            vc[slot, :, :length] = v[:, :length]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)
