"""`server.available_models`, `suggested_models`, `model_info` and `is_generator_model` over the registry and the
installed packages (no model is loaded), and `emberserve models`, the table they make."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGUFReader

import server
from engine import KNOWN_MODELS
from engine.registry import KnownModel
from server.config.model_catalog import models_text
from server.config.presets import PRESETS


def test_available_models_are_the_known_names_and_model_info_describes_each() -> None:
    assert server.available_models() == list(KNOWN_MODELS)
    assert all(isinstance(name, str) for name in server.available_models())
    for name in server.available_models():
        info, known = server.model_info(name), KNOWN_MODELS[name]
        assert isinstance(info, server.ModelInfo)
        assert (info.name, info.family, info.install, info.memory_mib) == \
            (name, known.family, known.install, known.memory_mib)
        assert info.installed and info.path == known.path()  # the suite installs every known model
        assert info.presets == tuple(p.name for p in PRESETS.values() if p.model == name)
        assert info.parameters and info.parameters > 0 and info.context_length and info.quantization
        files = [info.path] if info.path.is_file() else list(info.path.glob("*.safetensors"))
        assert info.size_bytes == sum(f.stat().st_size for f in files)


def test_model_info_tells_chat_base_and_embedding_models_apart() -> None:
    smol, gemma, minilm = (server.model_info(n) for n in ("smollm2-135m", "gemma3-270m", "all-minilm-l6-v2"))
    assert (smol.kind, smol.chat_tuned, smol.generator) == ("chat", True, True)  # SmolLM2-135M-Instruct
    assert (gemma.kind, gemma.chat_tuned, gemma.generator) == ("base", False, True)  # gemma-3-270m, not -it
    assert (minilm.kind, minilm.chat_tuned, minilm.generator) == ("embedding", False, False)
    reader = GGUFReader(smol.path)
    assert smol.parameters == sum(int(t.n_elements) for t in reader.tensors)
    assert smol.context_length == reader.fields["llama.context_length"].contents()
    assert (smol.quantization, gemma.quantization, minilm.quantization) == ("Q4_1", "Q4_K_M", "F32")
    with pytest.raises(ValueError, match=r"model not found: 'ghost' is neither a known model name \(smollm2-135m, "):
        server.model_info("ghost")


def test_a_model_not_installed_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    ghost = KnownModel(name="ghost-1b", family="llama", description="test", install="pip install ghost==1.0",
                       locate=lambda: None, chat_tuned=True)
    monkeypatch.setitem(KNOWN_MODELS, "ghost-1b", ghost)
    info = server.model_info("ghost-1b")
    assert not info.installed and info.path is None
    assert (info.parameters, info.size_bytes, info.quantization, info.context_length) == (None,) * 4
    assert "ghost-1b" in server.available_models() and "ghost-1b" not in server.suggested_models()
    row = next(line for line in models_text().splitlines() if line.startswith("ghost-1b "))
    assert row.split()[1:7] == ["llama", "-", "-", "-", "-", "chat"] and row.endswith("no: pip install ghost==1.0")


def test_suggested_models_are_installed_chat_models_the_presets_recommend_first() -> None:
    suggested = server.suggested_models()
    assert suggested[0] == "smollm2-135m"  # the smallest recommended one
    assert "all-minilm-l6-v2" not in suggested and "gemma3-270m" not in suggested  # an encoder, a base model
    assert all(isinstance(name, str) and server.model_info(name).chat_tuned for name in suggested)
    recommended = {p.model for p in PRESETS.values()}
    flags = [name in recommended for name in suggested]
    assert flags == sorted(flags, reverse=True)  # the recommended ones first


def test_an_encoder_cannot_be_declared_chat_tuned() -> None:
    with pytest.raises(ValueError, match="an encoder cannot be chat-tuned"):
        KnownModel(name="x", family="bert", description="", install="", locate=lambda: None, chat_tuned=True)


def test_is_generator_model_for_names_files_and_directories(tmp_path: Path) -> None:
    assert server.is_generator_model("smollm2-135m") and server.is_generator_model("gemma3-270m")
    assert not server.is_generator_model("all-minilm-l6-v2")
    assert server.is_generator_model(str(KNOWN_MODELS["smollm2-135m"].path()))  # a .gguf file
    assert not server.is_generator_model(str(KNOWN_MODELS["all-minilm-l6-v2"].path()))  # a BERT directory
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    assert server.is_generator_model(str(tmp_path))
    assert not server.is_generator_model(str(tmp_path / "missing.gguf"))
    assert not server.is_generator_model("no-such-model")


def test_emberserve_models_prints_a_table_of_every_known_model(tmp_path: Path) -> None:
    # an empty Hugging Face cache: `models` (the old name of `list`) lists what it holds as well (tests/e2e/test_hub.py)
    env = {**os.environ, "HF_HOME": str(tmp_path)}
    env.pop("HF_HUB_CACHE", None)
    done = subprocess.run([sys.executable, "-m", "server", "models"], capture_output=True, text=True, timeout=120,
                          env=env)
    assert done.returncode == 0, done.stderr
    header, *rows = done.stdout.splitlines()
    assert header.split() == ["name", "family", "parameters", "quantization", "context", "size", "kind", "installed"]
    assert [row.split()[0] for row in rows] == list(KNOWN_MODELS)
    for row in rows:
        info = server.model_info(row.split()[0])
        cells = row.split()
        assert cells[1] == info.family and cells[3] == info.quantization and cells[4] == str(info.context_length)
        assert f"{info.size_bytes / (1 << 20):.1f} MiB" in row and cells[-2:] == [info.kind, "yes"]
    smol = next(row for row in rows if row.startswith("smollm2-135m "))
    assert smol.split()[2] == "135M"  # SmolLM2-135M
    assert [row.split()[-2] for row in rows] == ["chat", "base", "embedding"]


def test_paths_are_models_too_and_a_models_dir_lists_its_own(tiny_gguf: Path, tmp_path: Path) -> None:
    split_dir = tmp_path / "models"
    split_dir.mkdir()
    for part in sorted(tiny_gguf.parent.glob("tiny-Q4_0-*-of-*.gguf")):
        (split_dir / part.name).write_bytes(part.read_bytes())
    (split_dir / "mmproj-tiny-F16.gguf").write_bytes(tiny_gguf.read_bytes())  # a sidecar, not a model
    (split_dir / "readme.txt").write_text("not a model")
    (split_dir / "empty").mkdir()
    first = split_dir / "tiny-Q4_0-00001-of-00003.gguf"
    info = server.model_info(str(first))
    assert (info.name, info.family, info.quantization, info.installed, info.install) == \
        (str(first), "llama", "Q4_0", True, "")
    assert info.kind == "chat" and info.size_bytes == sum(p.stat().st_size for p in split_dir.glob("tiny-Q4_0-*"))
    assert [i.name for i in server.list_models(split_dir)][len(KNOWN_MODELS):] == [str(first)]
    with pytest.raises(ValueError, match="models directory not found"):
        server.list_models(tmp_path / "nowhere")
    with pytest.raises(ValueError, match=r"'a/b:Q8_0' is not downloaded \(nor an existing path\); run: emberserve "
                                         r"pull a/b:Q8_0"):
        server.model_info("a/b:Q8_0")
    assert not server.is_generator_model("a/b:Q8_0")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model's Q4_0 GGUF split in three, and its first file."""
    from tests.support.tiny_models import build_tiny_model, write_gguf

    tiny = build_tiny_model("llama_tied", tmp_path_factory.mktemp("tiny"))
    return write_gguf(tiny, "Q4_0", tiny.safetensors_dir.parent / "tiny-Q4_0.gguf", split_max_tensors=8)
