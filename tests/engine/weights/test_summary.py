"""`read_summary`: a model's facts from its files' headers, against counts made independently (the `gguf` package's
GGUFReader, transformers' own parameter count, the safetensors package's reader, the models' published sizes), and
the chat-tuned rule for files the registry does not know."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from gguf import GGUFReader
from safetensors import safe_open

from engine.errors import ModelFormatError
from engine.registry import KNOWN_MODELS
from engine.weights.summary import chat_tuned, parameter_size, read_summary


def test_a_known_gguf_file_against_gguf_reader() -> None:
    path = KNOWN_MODELS["smollm2-135m"].path()
    summary, reader = read_summary(path), GGUFReader(path)
    assert summary.parameters == sum(int(t.n_elements) for t in reader.tensors)
    assert summary.parameter_size == reader.fields["general.size_label"].contents() == "135M"
    assert summary.file_type == "Q4_1" and ".Q4_1." in path.name  # general.file_type 3, as llama.cpp names it
    assert summary.context_length == reader.fields["llama.context_length"].contents()
    assert (summary.format, summary.family, summary.size_bytes) == ("gguf", "llama", path.stat().st_size)
    assert summary.has_chat_template and chat_tuned(summary, KNOWN_MODELS["smollm2-135m"])


def test_gemma_is_a_base_model_in_q4_k_m() -> None:
    path = KNOWN_MODELS["gemma3-270m"].path()
    summary = read_summary(path)
    assert summary.file_type == "Q4_K_M" and "q4_k_m" in path.name  # a mix of Q4_K, Q6_K, Q8_0... tensors
    assert summary.family == "gemma3" and summary.parameter_size == "268M"  # Gemma 3 "270M"
    assert not summary.has_chat_template and not chat_tuned(summary, KNOWN_MODELS["gemma3-270m"])


def test_a_safetensors_directory_against_the_safetensors_reader() -> None:
    directory = KNOWN_MODELS["all-minilm-l6-v2"].path()
    summary = read_summary(directory)
    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        slices = [f.get_slice(name) for name in f.keys()]
        weights = [math.prod(s.get_shape()) for s in slices if s.get_dtype() == "F32"]
        assert len(weights) == len(slices) - 1  # the int64 position ids are no weight
    assert summary.parameters == sum(weights) and summary.parameter_size == "22.7M"  # the model card's 22.7M
    assert (summary.format, summary.family, summary.file_type, summary.context_length) == \
        ("safetensors", "bert", "F32", 512)
    assert summary.size_bytes == (directory / "model.safetensors").stat().st_size
    assert not chat_tuned(summary, None)  # an encoder never chats


def test_unknown_files_are_chat_tuned_when_they_carry_a_chat_template(tiny_zoo, tmp_path: Path) -> None:
    tiny = tiny_zoo.model("llama_tied")
    hf = read_summary(tiny.safetensors_dir)
    assert hf.parameters == tiny.hf_model.num_parameters()  # tied embeddings counted once, as stored
    assert hf.file_type == "F32" and hf.context_length == tiny.config.max_position_embeddings
    assert hf.has_chat_template and chat_tuned(hf, None)
    for gguf_type in ("F32", "Q8_0"):
        path = tiny_zoo.gguf("llama_tied", gguf_type)
        summary = read_summary(path)
        assert summary.parameters == sum(int(t.n_elements) for t in GGUFReader(path).tensors) == hf.parameters
        assert summary.file_type == gguf_type and chat_tuned(summary, None)
    plain = tmp_path / "no-template"
    shutil.copytree(tiny.safetensors_dir, plain)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    for name in ("chat_template.jinja", "chat_template.json"):
        (plain / name).unlink(missing_ok=True)
    assert not chat_tuned(read_summary(plain), None)  # a base checkpoint: no template, no chat


def test_not_a_model(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_text("x")
    with pytest.raises(ModelFormatError, match="expected a .gguf file or a safetensors directory"):
        read_summary(tmp_path / "weights.bin")
    with pytest.raises(ModelFormatError, match="no config.json"):
        read_summary(tmp_path)


@pytest.mark.parametrize("count, shown", [(134_515_008, "135M"), (22_713_216, "22.7M"), (8_030_261_248, "8.03B"),
                                          (1_000, "1.00K"), (999, "999"), (70_553_706_496, "70.6B")])
def test_parameter_size_shows_three_significant_digits(count: int, shown: str) -> None:
    assert parameter_size(count) == shown
