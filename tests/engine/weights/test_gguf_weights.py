"""The GGUF reader and dequantizers against the `gguf` package's own reader and reference dequantizers."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from gguf.quants import dequantize as ref_dequantize, quantize

from engine.errors import ModelFormatError, UnsupportedModelError
from engine.registry import KNOWN_MODELS
from engine.weights.dequant import dequantize
from engine.weights.gguf import load_gguf, undo_llama_qk_permute
from engine.weights.gguf_format import GGUFFile


@pytest.fixture(scope="module")
def smollm_path() -> Path:
    return KNOWN_MODELS["smollm2-135m"].path()


def test_metadata_and_tensors_match_gguf_reader(smollm_path: Path) -> None:
    ours, ref = GGUFFile(smollm_path), GGUFReader(smollm_path)
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        if isinstance(value, float):
            assert ours.metadata[key] == pytest.approx(value), key
        else:
            assert ours.metadata[key] == value, key
    assert len(ours.tensors) == len(ref.tensors) == 272
    for t in ref.tensors:
        entry = ours.tensors[t.name]
        assert entry.ggml_type == t.tensor_type
        assert entry.shape == tuple(int(d) for d in reversed(t.shape.tolist()))
        assert np.array_equal(ours.raw(entry).reshape(-1), np.ascontiguousarray(t.data).view(np.uint8).reshape(-1))


def test_gemma_metadata_reads_fast() -> None:
    """GGUFReader takes seconds over gemma's 262k-entry vocabulary; the struct parser must not
    (bench/RESULTS.md#issue-32-gguf-metadata-time)."""
    path = KNOWN_MODELS["gemma3-270m"].path()
    t0 = time.perf_counter()
    meta = GGUFFile(path).metadata
    elapsed = time.perf_counter() - t0
    assert len(meta["tokenizer.ggml.tokens"]) == 262144
    assert meta["tokenizer.ggml.tokens"][818] == "The"
    assert elapsed < 3.0, f"metadata took {elapsed:.2f}s"


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.F16, Q.BF16])
def test_block_dequant_equals_reference(qtype: Q) -> None:
    rng = np.random.default_rng(int(qtype))
    x = (rng.standard_normal((48, 256)) * rng.uniform(0.01, 3, size=(48, 1))).astype(np.float32)
    packed = quantize(x, qtype)
    raw = packed.view(np.uint8).reshape(48, -1)
    ours = dequantize(raw, int(qtype), (48, 256))
    reference = torch.from_numpy(ref_dequantize(packed, qtype).astype(np.float32))
    assert torch.equal(ours, reference)
    # and the reference itself reproduces the original within the format's resolution
    block = GGML_QUANT_SIZES[qtype][0]
    err = (reference - torch.from_numpy(x)).abs().reshape(48, -1, block).amax(-1)
    scale = torch.from_numpy(np.abs(x)).reshape(48, -1, block).amax(-1)
    assert (err <= scale / 6 + 1e-6).all()


@pytest.mark.parametrize("qname", ["Q4_K", "Q6_K", "Q5_0", "Q8_0"])
def test_real_gemma_tensor_dequant(qname: str) -> None:
    gguf = GGUFFile(KNOWN_MODELS["gemma3-270m"].path())
    entry = next(e for e in gguf.tensors.values() if e.ggml_type == Q[qname] and e.name.startswith("blk."))
    ours = dequantize(gguf.raw(entry), entry.ggml_type, entry.shape, entry.name)
    reference = ref_dequantize(gguf.raw(entry), Q[qname]).reshape(entry.shape)
    assert ours.shape == entry.shape
    assert torch.equal(ours, torch.from_numpy(reference.astype(np.float32)))


def test_undo_permute_inverts_llama_cpp_permute() -> None:
    n_head, head_dim, hidden = 3, 8, 12
    w = torch.randn(n_head * head_dim, hidden)
    # llama.cpp's convert script: reshape(n_head, 2, dim/n_head/2, ...).swapaxes(1, 2)
    permuted = w.reshape(n_head, 2, head_dim // 2, hidden).swapaxes(1, 2).reshape(w.shape)
    assert not torch.equal(permuted, w)
    assert torch.equal(undo_llama_qk_permute(permuted, n_head), w)


def _write_gguf(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, Q | None]]) -> None:
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(2)
    for name, (array, raw_dtype) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelFormatError, match="not found"):
        GGUFFile(tmp_path / "nope.gguf")


def test_not_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    with pytest.raises(ModelFormatError, match="not a GGUF file"):
        GGUFFile(bad)


def test_truncated_file_says_where(tmp_path: Path, smollm_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(smollm_path.read_bytes()[:50_000_000])
    with pytest.raises(ModelFormatError, match="truncated file: tensor"):
        GGUFFile(cut)
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(smollm_path.read_bytes()[:100_000])
    with pytest.raises(ModelFormatError, match="truncated"):
        GGUFFile(header_only)


def test_unknown_architecture(tmp_path: Path) -> None:
    path = tmp_path / "mamba.gguf"
    _write_gguf(path, "mamba", {"token_embd.weight": (np.zeros((16, 32), np.float32), None)})
    with pytest.raises(UnsupportedModelError, match="'mamba'"):
        load_gguf(path)


def test_unsupported_tensor_type_is_named(tmp_path: Path) -> None:
    path = tmp_path / "q8k.gguf"
    block, size = GGML_QUANT_SIZES[Q.Q8_K]  # an activation-only type no model file should carry
    _write_gguf(path, "llama", {"token_embd.weight": (np.zeros((16, 256 // block * size), np.uint8), Q.Q8_K)})
    gguf = GGUFFile(path)
    entry = gguf.tensors["token_embd.weight"]
    with pytest.raises(UnsupportedModelError, match="token_embd.weight has type Q8_K"):
        dequantize(gguf.raw(entry), entry.ggml_type, entry.shape, entry.name)
