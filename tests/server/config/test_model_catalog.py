"""`server.available_models`, `suggested_models` and `is_generator_model` over the registry and the installed
packages (no model is loaded)."""
from __future__ import annotations

import json
from pathlib import Path

import server
from engine import KNOWN_MODELS
from server.config.presets import PRESETS


def test_available_models_describe_every_known_model_with_the_presets_recommending_it() -> None:
    listed = {m["name"]: m for m in server.available_models()}
    assert set(listed) == set(KNOWN_MODELS)
    smol, minilm = listed["smollm2-135m"], listed["all-minilm-l6-v2"]
    assert smol["installed"] and smol["generator"] and smol["memory_mib"] > 0
    assert set(smol["presets"]) == {p.name for p in PRESETS.values() if p.model == "smollm2-135m"}
    assert not minilm["generator"] and minilm["presets"] == []


def test_suggested_models_are_installed_generators_the_presets_recommend_first() -> None:
    suggested = server.suggested_models()
    names = [m["name"] for m in suggested]
    assert names[0] == "smollm2-135m"  # the smallest recommended one
    assert "all-minilm-l6-v2" not in names
    assert all(m["installed"] and m["generator"] for m in suggested)
    recommended = [m for m in suggested if m["presets"]]
    assert suggested[:len(recommended)] == recommended
    assert [m["memory_mib"] for m in recommended] == sorted(m["memory_mib"] for m in recommended)


def test_is_generator_model_for_names_files_and_directories(tmp_path: Path) -> None:
    assert server.is_generator_model("smollm2-135m") and server.is_generator_model("gemma3-270m")
    assert not server.is_generator_model("all-minilm-l6-v2")
    assert server.is_generator_model(str(KNOWN_MODELS["smollm2-135m"].path()))  # a .gguf file
    assert not server.is_generator_model(str(KNOWN_MODELS["all-minilm-l6-v2"].path()))  # a BERT directory
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    assert server.is_generator_model(str(tmp_path))
    assert not server.is_generator_model(str(tmp_path / "missing.gguf"))
    assert not server.is_generator_model("no-such-model")
