"""Which models a `Generator` can be built for: `available_models`, `suggested_models`, `is_generator_model`."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine import KNOWN_MODELS
from engine import available_models as _registry_models
from engine.config import ENCODER_FAMILIES

from server.config.presets import PRESETS


def available_models() -> list[dict[str, Any]]:
    """Every known model: name, family, description, installed, the install command, whether it generates text
    (`generator`: an encoder only embeds), its approximate memory (`memory_mib`) and the presets recommending it."""
    return [m | {"presets": [p.name for p in PRESETS.values() if p.model == m["name"]]} for m in _registry_models()]


def suggested_models() -> list[dict[str, Any]]:
    """The installed models a Generator can use, smallest first: the ones the presets recommend, then the others
    (each as `available_models` describes it)."""
    usable = [m for m in available_models() if m["generator"] and m["installed"]]
    return sorted(usable, key=lambda m: (not m["presets"], m["memory_mib"] or float("inf"), m["name"]))


def is_generator_model(name: str) -> bool:
    """Whether `name` is a model that generates text: a known decoder's name, a .gguf file, or a safetensors
    directory whose config.json is not an encoder's (an encoder such as all-minilm-l6-v2 only embeds)."""
    known = KNOWN_MODELS.get(name)
    if known is not None:
        return known.is_generator
    path = Path(name)
    if path.is_file():
        return path.suffix == ".gguf"
    config = path / "config.json"
    if not config.is_file():
        return False
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return False
    return model_type is not None and model_type not in ENCODER_FAMILIES
