"""Which models there are and which a `Generator` can be built for: `available_models`, `suggested_models`,
`model_info` (a model's facts, `ModelInfo`: a known name, a Hugging Face name in the local cache, a path),
`list_models` and `models_text` (`emberserve list`), `is_generator_model`."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from engine import KNOWN_MODELS
from engine.config import ENCODER_FAMILIES
from engine.errors import EngineError
from engine.hub.cache import cached_models
from engine.hub.names import gguf_part, hub_name, is_model_file
from engine.registry import model_path
from engine.weights.summary import WeightsSummary, chat_tuned, parameter_size, read_summary

from server.config.presets import PRESETS


@dataclass(frozen=True)
class ModelInfo:
    """A model: what the registry says of a known one, and once it is installed what its files' headers say (read
    without loading the weights; None while it is not installed, or when its files cannot be read). A Hugging Face
    model in the local cache or a model file or directory of one's own is described by its files alone."""

    name: str
    family: str
    description: str
    installed: bool
    install: str                 # the command that installs it (`emberserve pull NAME` for a Hugging Face model)
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
    """The facts of the model `name`: a known name, a Hugging Face name pulled into the local cache, a .gguf file or
    a safetensors directory (ValueError saying why otherwise: unknown, not pulled, not a model the engine runs)."""
    known = KNOWN_MODELS.get(name)
    if known is None:
        try:
            path = model_path(name)
        except EngineError as e:
            raise ValueError(str(e)) from None
        info = files_info(name, path)
        if info is None:
            raise ValueError(f"{name}: {_summary_error(path)}")
        return info
    path = known.installed_path()
    summary = _summary(path) if path is not None else None
    return ModelInfo(
        name=known.name, family=known.family, description=known.description, installed=path is not None,
        install=known.install, generator=known.is_generator, chat_tuned=known.chat_tuned,
        memory_mib=known.memory_mib, kind=known.kind,
        presets=tuple(p.name for p in PRESETS.values() if p.model == known.name), path=path,
        size_bytes=summary and summary.size_bytes, parameters=summary and summary.parameters,
        quantization=summary and summary.file_type, context_length=summary and summary.context_length)


def files_info(name: str, path: Path) -> ModelInfo | None:
    """A model that is not a known one, from its files (None when they are not a model the engine runs)."""
    summary = _summary(path)
    if summary is None:
        return None
    hub = hub_name(name)
    generator = summary.family not in ENCODER_FAMILIES
    tuned = chat_tuned(summary, None)
    where = f"{path.name} of Hugging Face {hub.repo}" if hub and path.is_file() else \
        f"Hugging Face {hub.repo}" if hub else str(path)
    return ModelInfo(
        name=name, family=summary.family, description=f"{summary.format}: {where}", installed=True,
        install=f"emberserve pull {name}" if hub else "", generator=generator, chat_tuned=tuned, memory_mib=None,
        kind="embedding" if not generator else "chat" if tuned else "base", presets=(), path=path,
        size_bytes=summary.size_bytes, parameters=summary.parameters, quantization=summary.file_type,
        context_length=summary.context_length)


def list_models(models_dir: str | Path | None = None) -> list[ModelInfo]:
    """Every model there is to serve: the known ones (installed or not), the Hugging Face models pulled into the
    local cache that the engine runs, and with `models_dir` the models in that directory (.gguf files, a split one
    by its first part, and safetensors directories), named by their path."""
    infos = [model_info(name) for name in available_models()]
    for model in cached_models():
        info = files_info(str(model.name), model.path)
        if info is not None:
            infos.append(info)
    if models_dir is not None:
        directory = Path(models_dir)
        if not directory.is_dir():
            raise ValueError(f"models directory not found: {directory}")
        for entry in sorted(directory.iterdir()):
            part = gguf_part(entry.name)
            first = entry.is_file() and is_model_file(entry.name) and part is not None and part.index == 1
            if first or (entry.is_dir() and (entry / "config.json").is_file()):
                info = files_info(str(entry), entry)
                if info is not None:
                    infos.append(info)
    return infos


def _summary(path: Path) -> WeightsSummary | None:
    try:
        return read_summary(path)
    except (EngineError, OSError, ValueError):  # unreadable files: the facts stay unknown, the listing goes on
        return None


def _summary_error(path: Path) -> str:
    """Why `_summary` found no model at `path`."""
    try:
        read_summary(path)
    except (EngineError, OSError, ValueError) as e:
        return str(e)
    return "not a model"


def _mib(size: int | None) -> str:
    return "-" if size is None else f"{size / (1 << 20):.1f} MiB"


def models_text(infos: list[ModelInfo] | None = None) -> str:
    """Models (default: `list_models()`) as an aligned table with a header, for the terminal (`emberserve list`)."""
    header = ("name", "family", "parameters", "quantization", "context", "size", "kind", "installed")
    rows = [header]
    for info in list_models() if infos is None else infos:
        rows.append((info.name, info.family, "-" if info.parameters is None else parameter_size(info.parameters),
                     info.quantization or "-", "-" if info.context_length is None else str(info.context_length),
                     _mib(info.size_bytes), info.kind, "yes" if info.installed else f"no: {info.install}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    return "\n".join("  ".join([*(cell.ljust(w) for cell, w in zip(row, widths)), row[-1]]) for row in rows)


def is_generator_model(name: str) -> bool:
    """Whether `name` is a model that generates text: a known decoder's name, a .gguf file, or a safetensors
    directory whose config.json is not an encoder's (an encoder such as all-minilm-l6-v2 only embeds), given as a
    path or a pulled Hugging Face name."""
    known = KNOWN_MODELS.get(name)
    if known is not None:
        return known.is_generator
    try:
        path = model_path(name)
    except EngineError:
        return False
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
