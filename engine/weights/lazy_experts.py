"""Expert stacks read one expert at a time: what the GGUF reader puts in a state dict for a 3-D expert tensor.

A 30B mixture of experts at 4 bits is nearly all expert weights; decoded whole they would take two to seven times
the file (uint8 codes with float scales, or floats), so the reader keeps them where they are (the memory-mapped
file) and hands out a `LazyExperts`: a sequence of E per-expert weights [out, in], each decoded from the file when
it is asked for — an exact `Affine4Bit` for 4-bit blocks (Q4_0, Q4_1, Q4_K) when the loader keeps 4 bits, else a
float32 tensor. Whoever packs the experts (an expert stack module) takes them one by one; `to(dtype=...)` fills
one tensor of the compute dtype an expert at a time, for the float path. The loader's fuse step joins the gate and
up stacks with `cat`, lazily too.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Union

import torch

from engine.model.quant import Affine4Bit

ExpertWeight = Union[torch.Tensor, Affine4Bit]


def _dense(w: ExpertWeight) -> torch.Tensor:
    return w.dequantize() if isinstance(w, Affine4Bit) else w


class LazyExperts(Sequence[ExpertWeight]):
    """E experts' weights of one projection, [E, out, in], each read by `read(expert)` when asked for.

    `four_bit`: the experts come as `Affine4Bit` (else as float32 tensors). `ggml_type`: the file's type of the
    weights (None for a concatenation of stacks of different types); `raw(expert)`: that expert's bytes in the file
    (uint8 [out, bytes per row]), for a packer that reads a format directly (GGUF's MXFP4 blocks).
    """

    def __init__(self, count: int, out_features: int, in_features: int, read: Callable[[int], ExpertWeight],
                 four_bit: bool, ggml_type: int | None = None,
                 raw: Callable[[int], object] | None = None, name: str = "") -> None:
        self._count, self._read, self._raw = count, read, raw
        self.out_features, self.in_features = out_features, in_features
        self.four_bit, self.ggml_type, self.name = four_bit, ggml_type, name

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self._count, self.out_features, self.in_features))

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, expert: int) -> ExpertWeight:  # type: ignore[override]
        if not isinstance(expert, int):
            raise TypeError(f"LazyExperts takes one expert's index, not {type(expert).__name__}")
        if not -self._count <= expert < self._count:
            raise IndexError(f"expert {expert} of {self._count}")
        w = self._read(expert % self._count)
        if tuple(w.shape) != (self.out_features, self.in_features):
            raise ValueError(f"{self.name}: expert {expert} read as {tuple(w.shape)}, expected "
                             f"{(self.out_features, self.in_features)}")
        return w

    def __iter__(self) -> Iterator[ExpertWeight]:
        return (self[e] for e in range(self._count))

    def raw(self, expert: int) -> object:
        """The expert's bytes in the file (a read-only uint8 numpy view of the memory map)."""
        if self._raw is None:
            raise ValueError(f"{self.name}: no single file tensor behind these experts")
        return self._raw(expert)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """All experts as one [E, out, in] tensor of `dtype`, filled an expert at a time: besides the result, no
        more than one expert's float32 copy is held."""
        out = torch.empty(tuple(self.shape), dtype=dtype)
        for e in range(self._count):
            out[e] = _dense(self[e])
        return out

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """As `Tensor.to`: the experts materialised (in `dtype`, float32 if not given), then on `device`."""
        stacked = self.dequantize(dtype or torch.float32)
        return stacked if device is None else stacked.to(device)

    def narrow(self, start: int, length: int) -> LazyExperts:
        """Experts start..start + length (an expert-parallel rank's share), still unread."""
        if start < 0 or length < 0 or start + length > self._count:
            raise IndexError(f"experts {start}..{start + length} of {self._count}")
        raw = None if self._raw is None else (lambda e: self._raw(start + e))
        return LazyExperts(length, self.out_features, self.in_features, lambda e: self._read(start + e),
                           self.four_bit, self.ggml_type, raw, self.name)

    @staticmethod
    def cat(parts: Sequence[LazyExperts], dim: int = 1) -> LazyExperts:
        """The stacks' output rows concatenated, expert by expert (the gate rows, then the up rows)."""
        if dim not in (1, -2):
            raise ValueError("expert stacks concatenate along their output rows (dim 1)")
        count, in_features = len(parts[0]), parts[0].in_features
        if any(len(p) != count or p.in_features != in_features for p in parts):
            raise ValueError(f"cannot concatenate expert stacks of shapes {[tuple(p.shape) for p in parts]}")
        four_bit = all(p.four_bit for p in parts)

        def read(e: int) -> ExpertWeight:
            ws = [p[e] for p in parts]
            return Affine4Bit.cat(ws) if four_bit else torch.cat([_dense(w) for w in ws])

        types = {p.ggml_type for p in parts}
        return LazyExperts(count, sum(p.out_features for p in parts), in_features, read, four_bit,
                           types.pop() if len(types) == 1 else None, None, "+".join(p.name for p in parts))

    def __repr__(self) -> str:
        kind = "Affine4Bit" if self.four_bit else "float32"
        return f"LazyExperts({self.name or '?'}, {tuple(self.shape)}, {kind} per expert)"
