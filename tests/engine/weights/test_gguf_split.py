"""GGUF models split the llama.cpp way (gguf-split; here gguf-py's writer with split_max_tensors, the same format:
`<stem>-0000i-of-0000N.gguf`, the metadata in the first file, `split.*` keys in each) read as the whole file."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.errors import ModelFormatError
from engine.weights.gguf_format import SPLIT_COUNT, SPLIT_NO, SPLIT_TENSORS, GGUFFile
from engine.weights.summary import read_summary
from tests.support.tiny_models import write_gguf


@pytest.fixture(scope="module")
def whole_and_parts(tiny_zoo, tmp_path_factory) -> tuple[Path, list[Path]]:
    tiny = tiny_zoo.model("llama_tied")
    first = write_gguf(tiny, "Q8_0", tmp_path_factory.mktemp("split") / "tiny-Q8_0.gguf", split_max_tensors=5)
    return tiny_zoo.gguf("llama_tied", "Q8_0"), sorted(first.parent.glob("tiny-Q8_0-*-of-*.gguf"))


def test_any_part_opens_the_whole_model(whole_and_parts) -> None:
    whole_path, parts = whole_and_parts
    assert len(parts) >= 3 and parts[0].name == f"tiny-Q8_0-00001-of-{len(parts):05d}.gguf"
    whole = GGUFFile(whole_path)
    for given in parts:
        split = GGUFFile(given)
        assert split.paths == parts
        assert {k: v for k, v in split.metadata.items() if not k.startswith("split.")} == whole.metadata
        assert (split.metadata[SPLIT_COUNT], split.metadata[SPLIT_NO], split.metadata[SPLIT_TENSORS]) == \
            (len(parts), 0, len(whole.tensors))
        assert list(split.tensors) == list(whole.tensors)
        assert {e.part for e in split.tensors.values()} == set(range(len(parts)))
        for name, entry in whole.tensors.items():
            ours = split.tensors[name]
            assert (ours.shape, ours.ggml_type) == (entry.shape, entry.ggml_type)
            assert np.array_equal(split.raw(ours), whole.raw(entry)), name


def test_the_summary_counts_every_part(whole_and_parts) -> None:
    whole_path, parts = whole_and_parts
    whole, split = read_summary(whole_path), read_summary(parts[0])
    assert (split.family, split.parameters, split.file_type, split.context_length, split.has_chat_template) == \
        (whole.family, whole.parameters, whole.file_type, whole.context_length, whole.has_chat_template)
    assert split.size_bytes == sum(p.stat().st_size for p in parts)


def test_a_missing_or_renamed_part_is_named(whole_and_parts, tmp_path: Path) -> None:
    _, parts = whole_and_parts
    for part in parts[:1] + parts[2:]:
        (tmp_path / part.name).write_bytes(part.read_bytes())
    with pytest.raises(ModelFormatError, match=f"model file not found: .*{parts[1].name}"):
        GGUFFile(tmp_path / parts[0].name)
    (tmp_path / parts[0].name).rename(tmp_path / "tiny.gguf")
    with pytest.raises(ModelFormatError, match=r"not named <name>-00001-of-0000\d.gguf"):
        GGUFFile(tmp_path / "tiny.gguf")
