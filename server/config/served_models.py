"""The models one server serves: `servable_models` (the ones named with --model / --models, the ones found under
--models-dir, each with the id clients send, --served-model-name's aliases)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from engine.registry import KNOWN_MODELS

from server.config.settings import Settings

# The parts after the first of a split GGUF (name-00002-of-00003.gguf): loaded with the first, not on their own.
_LATER_SPLIT_PART = re.compile(r"-(\d{5})-of-\d{5}\.gguf$")


@dataclass(frozen=True)
class ServableModel:
    """A model the server can load: where it is (a known name or a path, as `engine.registry.model_path` takes it)
    and the id clients send for it (its alias, else its name)."""

    id: str
    source: str


def model_name(source: str) -> str:
    """The id a model gets without an alias: a known model's name, else its file or directory name (the name the
    engine gives the runner, so that one model keeps the id it has in the one-model server)."""
    return source if source in KNOWN_MODELS else Path(source).name


def models_in(directory: Path) -> list[str]:
    """The models in `directory`, sorted: its .gguf files (a split one by its first part) and the directories that
    hold a config.json (safetensors checkpoints)."""
    found = []
    for path in sorted(directory.iterdir()):
        if path.is_file() and path.suffix == ".gguf":
            split = _LATER_SPLIT_PART.search(path.name)
            if split is None or split.group(1) == "00001":
                found.append(str(path))
        elif path.is_dir() and (path / "config.json").is_file():
            found.append(str(path))
    return found


def aliases(settings: Settings) -> dict[str, str]:
    """--served-model-name as MODEL=alias pairs (comma-separated); a plain alias names the first model's."""
    given = settings.served_model_name
    if given is None:
        return {}
    pairs = {}
    for part in (p.strip() for p in given.split(",")):
        if not part:
            continue
        model, sep, alias = part.rpartition("=")
        pairs[model.strip() if sep else settings.model] = alias.strip()
    return pairs


def alias_of(settings: Settings, name: str) -> str | None:
    """The alias --served-model-name gives the one model (`name`: its runner's name), if any: a plain alias as it
    is, or the one of a MODEL=alias pair naming it."""
    given = settings.served_model_name
    if given is None:
        return None
    for part in given.split(","):
        model, sep, alias = part.rpartition("=")
        if sep and model.strip() in (settings.model, name):
            return alias.strip()
    return given


def servable_models(settings: Settings) -> list[ServableModel]:
    """Every model the server can serve, the first being the default (--model); ValueError (one line) for a
    missing models directory, an alias of no model, or two models with one id."""
    sources = [settings.model, *settings.models]
    if settings.models_dir is not None:
        directory = Path(settings.models_dir)
        if not directory.is_dir():
            raise ValueError(f"--models-dir {settings.models_dir!r}: not a directory")
        sources += [s for s in models_in(directory) if s not in sources]
    names = aliases(settings)
    models, seen = [], {}
    for source in dict.fromkeys(sources):  # each once, in order
        alias = names.pop(source, None) or names.pop(model_name(source), None)
        model_id = alias or model_name(source)
        if model_id in seen:
            raise ValueError(f"two models would be served as {model_id!r} ({seen[model_id]} and {source}): give "
                             f"one an alias with --served-model-name {source}=ALIAS")
        seen[model_id] = source
        models.append(ServableModel(model_id, source))
    if names:
        raise ValueError(f"--served-model-name gives an alias to {', '.join(map(repr, names))}, not a served "
                         f"model (they are {', '.join(m.source for m in models)})")
    return models
