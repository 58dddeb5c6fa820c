"""A fast reader of the GGUF container: metadata and tensor directory, without building per-string numpy views."""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.errors import ModelFormatError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types → (struct format, numpy dtype); 8 = string, 9 = array.
_SCALAR_TYPES: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"),
    4: ("<I", "<u4"), 5: ("<i", "<i4"), 6: ("<f", "<f4"), 7: ("<?", "?"),
    10: ("<Q", "<u8"), 11: ("<q", "<i8"), 12: ("<d", "<f8"),
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the directory: its torch-order shape, ggml type id and absolute byte range."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int
    nbytes: int


class GGUFCursor:
    def __init__(self, buf: memoryview, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def _need(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            raise ModelFormatError(f"{self.path}: truncated GGUF header (wanted {n} bytes at offset {self.pos})")

    def scalar(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        self._need(size)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        self._need(n)
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def strings(self, count: int) -> list[str]:
        # The hot path for 262k-entry vocabularies: one unpack per entry, no numpy views.
        buf, pos, out = self.buf, self.pos, []
        unpack, end = struct.Struct("<Q").unpack_from, len(buf)
        raw = buf.obj if isinstance(buf.obj, (bytes, mmap.mmap)) else bytes(buf)
        for _ in range(count):
            if pos + 8 > end:
                raise ModelFormatError(f"{self.path}: truncated GGUF string array")
            (n,) = unpack(raw, pos)
            pos += 8
            if pos + n > end:
                raise ModelFormatError(f"{self.path}: truncated GGUF string array")
            out.append(raw[pos:pos + n].decode("utf-8", errors="replace"))
            pos += n
        self.pos = pos
        return out

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.scalar("<I"), self.scalar("<Q")
            if etype == _STRING:
                return self.strings(count)
            if etype in _SCALAR_TYPES:
                dtype = np.dtype(_SCALAR_TYPES[etype][1])
                self._need(count * dtype.itemsize)
                arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
                self.pos += count * dtype.itemsize
                return arr.tolist()
            return [self.value(etype) for _ in range(count)]
        if vtype in _SCALAR_TYPES:
            return self.scalar(_SCALAR_TYPES[vtype][0])
        raise ModelFormatError(f"{self.path}: unknown GGUF metadata value type {vtype}")


def _block_shape(ggml_type: int) -> tuple[int, int]:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        return GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise ModelFormatError(f"unknown ggml tensor type id {ggml_type}") from None


class GGUFFile:
    """A memory-mapped GGUF file: `metadata` (plain Python values), `tensors` (name → TensorEntry), raw bytes."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelFormatError(f"model file not found: {self.path}")
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                raise ModelFormatError(f"{self.path}: file too small to be GGUF ({size} bytes)")
            self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if self._mmap[:4] != GGUF_MAGIC:
            raise ModelFormatError(f"{self.path}: not a GGUF file (magic {self._mmap[:4]!r})")
        cur = GGUFCursor(memoryview(self._mmap), self.path)
        cur.pos = 4
        self.version = cur.scalar("<I")
        if self.version not in (2, 3):
            raise ModelFormatError(f"{self.path}: unsupported GGUF version {self.version}")
        n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.scalar("<I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.scalar("<I")
            dims = [cur.scalar("<Q") for _ in range(n_dims)]
            infos.append((name, dims, cur.scalar("<I"), cur.scalar("<Q")))
        align = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = (cur.pos + align - 1) // align * align
        self.tensors: dict[str, TensorEntry] = {}
        for name, dims, ggml_type, rel in infos:
            block, type_size = _block_shape(ggml_type)
            n = int(np.prod(dims)) if dims else 1
            if dims and dims[0] % block:
                raise ModelFormatError(f"{self.path}: tensor {name} row of {dims[0]} is not a multiple of its block size {block}")
            nbytes = n // block * type_size
            entry = TensorEntry(name, tuple(int(d) for d in reversed(dims)), ggml_type, data_start + rel, nbytes)
            if entry.offset + nbytes > size:
                raise ModelFormatError(
                    f"{self.path}: truncated file: tensor {name} ends at byte {entry.offset + nbytes}, file has {size}")
            self.tensors[name] = entry

    def raw(self, entry: TensorEntry) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 array shaped [rows..., bytes per row]."""
        arr = np.frombuffer(self._mmap, dtype=np.uint8, count=entry.nbytes, offset=entry.offset)
        rows = entry.shape[:-1] if len(entry.shape) > 1 else ()
        return arr.reshape(*rows, -1)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))


def read_gguf_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """GGUF key → value (strings as str, arrays as lists); fast even for 262k-entry vocabularies."""
    return GGUFFile(path).metadata
