"""Which models there are and which a `Generator` can be built for: `available_models`, `suggested_models`,
`model_info` (a known model's facts, `ModelInfo`), `models_text` (`emberserve models`), `is_generator_model`."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from engine import KNOWN_MODELS
from engine.config import ENCODER_FAMILIES
from engine.errors import EngineError
from engine.weights.summary import WeightsSummary, parameter_size, read_summary

from server.config.presets import PRESETS


@dataclass(frozen=True)
class ModelInfo:
    """A known model: what the registry says of it, and once it is installed what its files' headers say (read
    without loading the weights; None while it is not installed, or when its files cannot be read)."""

    name: str
    family: str
    description: str
    installed: bool
    install: str                 # the command that installs it
    generator: bool              # it generates text (an encoder only embeds)
    chat_tuned: bool             # tuned to chat; a base model only continues text
    memory_mib: int | None       # approximate resident memory of the default CPU server once loaded
    kind: Literal["chat", "base", "embedding"]  # KnownModel.kind: chat-tuned, base, or an embedding encoder
    presets: tuple[str, ...]     # the presets recommending it
    path: Path | None = None     # the weights: a .gguf file or a safetensors directory
    size_bytes: int | None = None      # the weights files on disk
    parameters: int | None = None      # every weight tensor's elements
    quantization: str | None = None    # the weights' type in the file: Q4_1, Q4_K_M, F32, BF16, ...
    context_length: int | None = None  # the context it was trained for


def available_models() -> list[str]:
    """The name of every known model, installed or not (`model_info(name)` tells the rest)."""
    return list(KNOWN_MODELS)


def suggested_models() -> list[str]:
    """The installed chat-tuned models, for a chat `Generator`: the ones the presets recommend first, then the
    others, smallest first."""
    recommended = {p.model for p in PRESETS.values()}
    usable = [m for m in KNOWN_MODELS.values() if m.chat_tuned and m.installed()]
    usable.sort(key=lambda m: (m.name not in recommended, m.memory_mib or math.inf, m.name))
    return [m.name for m in usable]


def model_info(name: str) -> ModelInfo:
    """The facts of the known model `name` (ValueError listing the known names otherwise)."""
    known = KNOWN_MODELS.get(name)
    if known is None:
        raise ValueError(f"unknown model {name!r}; the known models are {', '.join(KNOWN_MODELS)}")
    path = known.installed_path()
    summary = _summary(path) if path is not None else None
    return ModelInfo(
        name=known.name, family=known.family, description=known.description, installed=path is not None,
        install=known.install, generator=known.is_generator, chat_tuned=known.chat_tuned,
        memory_mib=known.memory_mib, kind=known.kind,
        presets=tuple(p.name for p in PRESETS.values() if p.model == known.name), path=path,
        size_bytes=summary and summary.size_bytes, parameters=summary and summary.parameters,
        quantization=summary and summary.file_type, context_length=summary and summary.context_length)


def _summary(path: Path) -> WeightsSummary | None:
    try:
        return read_summary(path)
    except (EngineError, OSError):  # unreadable files: the facts stay unknown, the listing goes on
        return None


def _mib(size: int | None) -> str:
    return "-" if size is None else f"{size / (1 << 20):.1f} MiB"


def models_text() -> str:
    """The known models as an aligned table with a header, for the terminal (`emberserve models`)."""
    header = ("name", "family", "parameters", "quantization", "context", "size", "kind", "installed")
    rows = [header]
    for info in (model_info(name) for name in available_models()):
        rows.append((info.name, info.family, "-" if info.parameters is None else parameter_size(info.parameters),
                     info.quantization or "-", "-" if info.context_length is None else str(info.context_length),
                     _mib(info.size_bytes), info.kind, "yes" if info.installed else f"no: {info.install}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    return "\n".join("  ".join([*(cell.ljust(w) for cell, w in zip(row, widths)), row[-1]]) for row in rows)


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
