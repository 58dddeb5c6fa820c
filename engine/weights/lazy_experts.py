"""Expert stacks read one expert at a time: what the GGUF reader puts in a state dict for a 3-D expert tensor.

A 30B mixture of experts at 4 bits is nearly all expert weights; decoded whole they would take two to seven times
the file (uint8 codes with float scales, or floats), so the reader keeps them where they are (the memory-mapped
file) and hands out a `LazyExperts`: a sequence of E per-expert weights [out, in], each decoded from the file when
it is asked for, in the stack's `form`:

- "affine4bit": exact `Affine4Bit` codes (Q4_0, Q4_1, Q4_K blocks, when the loader keeps 4 bits);
- "mxfp4": exact `Mxfp4Tensor` blocks (GGUF's MXFP4, whatever the mode: 4 bits are what gpt-oss ships);
- "float": float32 tensors (every other type, or 4-bit blocks when the loader does not keep them).

Whoever packs the experts takes them one by one (an expert stack module packs an iterable of experts as it comes,
engine/model/quant/experts.py), or `stacked()` in their own form (MXFP4 stacks stay as they are); `to(dtype=...)`
fills one tensor of the compute dtype an expert at a time, for the float path. The loader's fuse step joins the
gate and up stacks with `cat`, lazily too.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Literal, Union

import torch

from engine.model.quant import GROUP_SIZE, Affine4Bit
from engine.model.quant.experts import dense_expert
from engine.model.quant.mxfp4 import MXFP4_BLOCK, Mxfp4Tensor

ExpertWeight = Union[torch.Tensor, Affine4Bit, Mxfp4Tensor]
ExpertForm = Literal["float", "affine4bit", "mxfp4"]
_FORMS = {"float": torch.Tensor, "affine4bit": Affine4Bit, "mxfp4": Mxfp4Tensor}


def form_of(w: ExpertWeight) -> ExpertForm:
    """The form of a weight (one expert's, a stack's or a plain linear's): float, affine4bit or mxfp4."""
    return "affine4bit" if isinstance(w, Affine4Bit) else "mxfp4" if isinstance(w, Mxfp4Tensor) else "float"


class LazyExperts(Sequence[ExpertWeight]):
    """E experts' weights of one projection, [E, out, in], each read by `read(expert)` when asked for, in `form`.

    `ggml_type`: the file's type of the weights (None for a concatenation of stacks of different types);
    `raw(expert)`: that expert's bytes in the file (uint8 [out, bytes per row]), for a packer that reads a format
    directly.
    """

    def __init__(self, count: int, out_features: int, in_features: int, read: Callable[[int], ExpertWeight],
                 form: ExpertForm, ggml_type: int | None = None,
                 raw: Callable[[int], object] | None = None, name: str = "") -> None:
        if form not in _FORMS:
            raise ValueError(f"unknown expert form {form!r}")
        self._count, self._read, self._raw = count, read, raw
        self.out_features, self.in_features = out_features, in_features
        self.form, self.ggml_type, self.name = form, ggml_type, name

    @property
    def four_bit(self) -> bool:
        """Whether the experts come as exact `Affine4Bit` codes."""
        return self.form == "affine4bit"

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
        if not isinstance(w, _FORMS[self.form]) or tuple(w.shape) != (self.out_features, self.in_features):
            raise ValueError(f"{self.name}: expert {expert} read as {type(w).__name__} {tuple(w.shape)}, expected "
                             f"{self.form} {(self.out_features, self.in_features)}")
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
            out[e] = dense_expert(self[e])
        return out

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """As `Tensor.to`: the experts materialised (in `dtype`, float32 if not given), then on `device`."""
        stacked = self.dequantize(dtype or torch.float32)
        return stacked if device is None else stacked.to(device)

    def stacked(self) -> torch.Tensor | Affine4Bit | Mxfp4Tensor:
        """All experts in their own form, stacked [E, out, in] (float32, `Affine4Bit` or `Mxfp4Tensor`), written
        into tensors allocated once, an expert at a time."""
        if self.form == "float":
            return self.dequantize()
        e, out_f, in_f = self.shape
        if self.form == "affine4bit":
            groups = (e, out_f, in_f // GROUP_SIZE)
            whole = Affine4Bit(torch.empty(e, out_f, in_f, dtype=torch.uint8), torch.empty(groups),
                               torch.empty(groups))
        else:
            whole = Mxfp4Tensor(torch.empty(e, out_f, in_f // 2, dtype=torch.uint8),
                                torch.empty(e, out_f, in_f // MXFP4_BLOCK, dtype=torch.uint8))
        fields = ("codes", "scale", "offset") if self.form == "affine4bit" else ("blocks", "scales")
        for i in range(e):
            w = self[i]
            for f in fields:
                getattr(whole, f)[i] = getattr(w, f)
        return whole

    @staticmethod
    def of(source: torch.Tensor | Affine4Bit | Mxfp4Tensor | LazyExperts) -> LazyExperts:
        """Any stack of experts [E, out, in] as a `LazyExperts` (a stacked tensor's experts read as its views)."""
        if isinstance(source, LazyExperts):
            return source
        form = form_of(source)
        read = source.__getitem__ if form == "float" else source.select
        count, out_features, in_features = source.shape
        return LazyExperts(count, out_features, in_features, read, form)

    def map(self, fn: Callable[[ExpertWeight], ExpertWeight], out_features: int, in_features: int,
            form: ExpertForm) -> LazyExperts:
        """Each expert through `fn` ([out, in] in this stack's form → [out_features, in_features] in `form`) when
        it is read: a share of every expert, still unread."""
        return LazyExperts(self._count, out_features, in_features, lambda e: fn(self[e]), form, name=self.name)

    def narrow(self, start: int, length: int) -> LazyExperts:
        """Experts start..start + length (an expert-parallel rank's share), still unread."""
        if start < 0 or length < 0 or start + length > self._count:
            raise IndexError(f"experts {start}..{start + length} of {self._count}")
        raw = None if self._raw is None else (lambda e: self._raw(start + e))
        return LazyExperts(length, self.out_features, self.in_features, lambda e: self._read(start + e),
                           self.form, self.ggml_type, raw, self.name)

    @staticmethod
    def cat(parts: Sequence[LazyExperts], dim: int = 1) -> LazyExperts:
        """The stacks' output rows concatenated, expert by expert (the gate rows, then the up rows): in their
        form when they share one, else as floats."""
        if dim not in (1, -2):
            raise ValueError("expert stacks concatenate along their output rows (dim 1)")
        count, in_features = len(parts[0]), parts[0].in_features
        if any(len(p) != count or p.in_features != in_features for p in parts):
            raise ValueError(f"cannot concatenate expert stacks of shapes {[tuple(p.shape) for p in parts]}")
        forms = {p.form for p in parts}
        form = forms.pop() if len(forms) == 1 else "float"

        def read(e: int) -> ExpertWeight:
            ws = [p[e] for p in parts]
            if form == "affine4bit":
                return Affine4Bit.cat(ws)
            if form == "mxfp4":
                return Mxfp4Tensor.cat(ws)
            return torch.cat([dense_expert(w) for w in ws])

        types = {p.ggml_type for p in parts}
        return LazyExperts(count, sum(p.out_features for p in parts), in_features, read, form,
                           types.pop() if len(types) == 1 else None, None, "+".join(p.name for p in parts))

    def __repr__(self) -> str:
        return f"LazyExperts({self.name or '?'}, {tuple(self.shape)}, {self.form} per expert)"
