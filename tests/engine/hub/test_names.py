"""Hugging Face names and the files they mean: llama-server's `-hf owner/repo[:quant]` choice of GGUF file, a
safetensors checkpoint's files, over repo listings shaped like the Hub's (no network: engine/hub/names.py is pure)."""
from __future__ import annotations

import pytest

from engine.hub.names import (HubName, gguf_part, gguf_quants, has_torch_bin, hub_name, is_model_file,
                              parse_hub_name, safetensors_files, select_gguf)

# A quantizer's repo as bartowski/unsloth publish them: quants, a split one, a vision projector, an imatrix.
GGUF_REPO = ["README.md", ".gitattributes", "Model-IQ4_XS.gguf", "Model-Q4_K_S.gguf", "Model-Q8_0.gguf",
             "Model-Q4_K_M.gguf", "Model-BF16.gguf", "Model-F16.gguf", "mmproj-Model-F16.gguf", "Model.imatrix.gguf",
             "Q6_K/Model-Q6_K-00001-of-00002.gguf", "Q6_K/Model-Q6_K-00002-of-00002.gguf"]


@pytest.mark.parametrize("name, expected", [
    ("bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M", HubName("bartowski/Llama-3.2-1B-Instruct-GGUF", "Q4_K_M")),
    ("Qwen/Qwen3-0.6B", HubName("Qwen/Qwen3-0.6B")),
    ("unsloth/gemma-3-270m-it-GGUF:UD-Q4_K_XL", HubName("unsloth/gemma-3-270m-it-GGUF", "UD-Q4_K_XL")),
    ("smollm2-135m", None), ("/models/x.gguf", None), ("a/b/c", None), ("owner/", None), ("owner/repo:", None),
    ("./x/y", None),
])
def test_names_are_owner_repo_with_an_optional_quantization(name: str, expected: HubName | None) -> None:
    assert parse_hub_name(name) == expected
    if expected is not None:
        assert str(expected) == name


def test_an_existing_path_is_never_a_hub_name(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "x.gguf").write_bytes(b"")
    assert hub_name("models/x.gguf") is None
    assert hub_name("models/y.gguf") == HubName("models/y.gguf")


@pytest.mark.parametrize("quant, files", [
    ("Q8_0", ["Model-Q8_0.gguf"]), ("q8_0", ["Model-Q8_0.gguf"]), ("q4_k_m", ["Model-Q4_K_M.gguf"]),
    ("F16", ["Model-F16.gguf"]),  # not Model-BF16.gguf, nor the projector
    ("BF16", ["Model-BF16.gguf"]), ("Q4_K", []), ("Q5_K_M", []),
    ("Q6_K", ["Q6_K/Model-Q6_K-00001-of-00002.gguf", "Q6_K/Model-Q6_K-00002-of-00002.gguf"]),
])
def test_a_quantization_tag_picks_its_file_or_all_parts_of_a_split_one(quant: str, files: list[str]) -> None:
    assert select_gguf(GGUF_REPO, quant) == files


def test_the_default_is_q4_k_m_then_q8_0_then_the_first_model_file() -> None:
    assert select_gguf(GGUF_REPO, None) == ["Model-Q4_K_M.gguf"]
    assert select_gguf([f for f in GGUF_REPO if "Q4_K_M" not in f], None) == ["Model-Q8_0.gguf"]
    assert select_gguf(["mmproj-m-F16.gguf", "m-F16.gguf", "m-BF16.gguf"], None) == ["m-BF16.gguf"]
    assert select_gguf(["x-00002-of-00002.gguf", "x-00001-of-00002.gguf"], None) == \
        ["x-00001-of-00002.gguf", "x-00002-of-00002.gguf"]
    assert select_gguf(["README.md", "mmproj-F16.gguf", "model.safetensors"], None) == []


def test_file_names_read_the_llama_cpp_way() -> None:
    part = gguf_part("Q6_K/Model-Q6_K-00002-of-00002.gguf")
    assert (part.prefix, part.tag, part.index, part.count) == ("Q6_K/Model-Q6_K", "Q6_K", 2, 2)
    assert gguf_part("model.safetensors") is None and gguf_part("tiny.gguf").tag == ""
    assert not is_model_file("mmproj-Model-F16.gguf") and not is_model_file("Model.imatrix.gguf")
    assert is_model_file("Model-Q8_0.gguf") and not is_model_file("README.md")
    assert gguf_quants(GGUF_REPO) == ["BF16", "F16", "IQ4_XS", "Q4_K_M", "Q4_K_S", "Q8_0", "Q6_K"]  # by path


def test_a_safetensors_checkpoint_means_its_config_tokenizer_and_weights() -> None:
    repo = ["README.md", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
            "consolidated.safetensors", "pytorch_model.bin", "onnx/model.safetensors", "1_Pooling/config.json",
            "modules.json", "params.json"]
    shards = ["model-00002-of-00002.safetensors", "model-00001-of-00002.safetensors"]
    assert safetensors_files(repo, shards) == [
        "1_Pooling/config.json", "config.json", "generation_config.json", "model.safetensors.index.json",
        "modules.json", "tokenizer.json", "tokenizer_config.json",
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    # without an index, every top-level .safetensors file (as the engine reads a directory)
    assert safetensors_files(["config.json", "model.safetensors", "onnx/x.safetensors"]) == \
        ["config.json", "model.safetensors"]
    assert safetensors_files(["model.safetensors"]) == []  # no config.json
    assert safetensors_files(["config.json", "pytorch_model.bin"]) == [] and has_torch_bin(["pytorch_model.bin"])
    assert not has_torch_bin(["training_args.bin", "model.safetensors"])
