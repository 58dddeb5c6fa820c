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
from engine.hub.names import gguf_part, split_file_name

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types → (struct format, numpy dtype); 8 = string, 9 = array.
_SCALAR_TYPES: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"),
    4: ("<I", "<u4"), 5: ("<i", "<i4"), 6: ("<f", "<f4"), 7: ("<?", "?"),
    10: ("<Q", "<u8"), 11: ("<q", "<i8"), 12: ("<d", "<f8"),
}
_STRING, _ARRAY = 8, 9
# llama.cpp's split models (gguf-split): every file's number, the file count, the tensors of all files together
SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the directory: its torch-order shape, ggml type id and absolute byte range (in the `part`th file
    of a split model)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int
    nbytes: int
    part: int = 0


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


class _Part:
    """One GGUF file, memory-mapped: its metadata and its tensors' entries."""

    def __init__(self, path: Path, index: int) -> None:
        self.path = path
        if not path.is_file():
            raise ModelFormatError(f"model file not found: {path}")
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                raise ModelFormatError(f"{path}: file too small to be GGUF ({size} bytes)")
            self.mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if self.mmap[:4] != GGUF_MAGIC:
            raise ModelFormatError(f"{path}: not a GGUF file (magic {self.mmap[:4]!r})")
        cur = GGUFCursor(memoryview(self.mmap), path)
        cur.pos = 4
        self.version = cur.scalar("<I")
        if self.version not in (2, 3):
            raise ModelFormatError(f"{path}: unsupported GGUF version {self.version}")
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
                raise ModelFormatError(f"{path}: tensor {name} row of {dims[0]} is not a multiple of its block size "
                                       f"{block}")
            nbytes = n // block * type_size
            entry = TensorEntry(name, tuple(int(d) for d in reversed(dims)), ggml_type, data_start + rel, nbytes, index)
            if entry.offset + nbytes > size:
                raise ModelFormatError(
                    f"{path}: truncated file: tensor {name} ends at byte {entry.offset + nbytes}, file has {size}")
            self.tensors[name] = entry

    @property
    def split(self) -> tuple[int, int]:
        """(its 0-based number, the count) in a split model; (0, 1) for a whole file."""
        return int(self.metadata.get(SPLIT_NO, 0)), int(self.metadata.get(SPLIT_COUNT, 1))


def split_paths(path: Path, count: int) -> list[Path]:
    """The files of a model split `count` ways the llama.cpp way (`<prefix>-00001-of-0000N.gguf`, as gguf-split and
    gguf-py's writer name them), from any one of them."""
    part = gguf_part(path.name)
    if part is None or part.count != count:
        raise ModelFormatError(f"{path}: part of a model split in {count} files, but not named "
                               f"<name>-00001-of-{count:05d}.gguf as its parts must be")
    return [path.with_name(split_file_name(part.prefix, i, count)) for i in range(1, count + 1)]


class GGUFFile:
    """A memory-mapped GGUF model: `metadata` (plain Python values), `tensors` (name → TensorEntry), raw bytes.

    A model split by llama.cpp's gguf-split (or gguf-py's writer) into `<prefix>-0000i-of-0000N.gguf` files, each
    holding a share of the tensors and the first one the metadata (`split.no`, `split.count`,
    `split.tensors.count` in each), reads as one from any of its files: `paths` lists them all."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        first = _Part(self.path, 0)
        number, count = first.split
        parts = [first]
        if count > 1:
            paths = split_paths(self.path, count)
            if number != 0:
                first = _Part(paths[0], 0)
            parts = [first, *(_Part(p, i) for i, p in enumerate(paths[1:], 1))]
            for i, part in enumerate(parts):
                if part.split != (i, count):
                    raise ModelFormatError(f"{part.path}: split.no {part.split[0]} of {part.split[1]}, expected "
                                           f"{i} of {count}")
        self.version = first.version
        self.metadata = first.metadata
        self.paths = [part.path for part in parts]
        self._mmaps = [part.mmap for part in parts]
        self.tensors: dict[str, TensorEntry] = {}
        for part in parts:
            for name, entry in part.tensors.items():
                if name in self.tensors:
                    other = self.paths[self.tensors[name].part]
                    raise ModelFormatError(f"{part.path}: tensor {name} is also in {other}")
                self.tensors[name] = entry
        expected = self.metadata.get(SPLIT_TENSORS)
        if count > 1 and expected is not None and int(expected) != len(self.tensors):
            raise ModelFormatError(f"{self.paths[0]}: its {count} files hold {len(self.tensors)} tensors, "
                                   f"{SPLIT_TENSORS} says {expected}")

    @property
    def size_bytes(self) -> int:
        """Its files' size on disk."""
        return sum(p.stat().st_size for p in self.paths)

    def raw(self, entry: TensorEntry) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 array shaped [rows..., bytes per row]."""
        arr = np.frombuffer(self._mmaps[entry.part], dtype=np.uint8, count=entry.nbytes, offset=entry.offset)
        rows = entry.shape[:-1] if len(entry.shape) > 1 else ()
        return arr.reshape(*rows, -1)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))


def read_gguf_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """GGUF key → value (strings as str, arrays as lists); fast even for 262k-entry vocabularies."""
    return GGUFFile(path).metadata
