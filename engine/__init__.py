"""emberserve's engine: loads models and computes logits; knows nothing of HTTP.

The public names load on first use (PEP 562), so that importing a light module of the engine (its config, the
model registry) does not import torch and the runner: the CLI's settings and `--help` need only those.
"""
from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from engine.config import ModelConfig
from engine.errors import (ContextLengthError, DeviceError, EngineError, ModelFormatError, ModelNotInstalledError,
                           UnsupportedModelError)
from engine.registry import KNOWN_MODELS, available_models

if TYPE_CHECKING:  # what __getattr__ loads, for type checkers
    from engine.loader.load import load_runner
    from engine.runtime.runner import Runner, SessionSnapshot

_LAZY = {"load_runner": "engine.loader.load", "Runner": "engine.runtime.runner",
         "SessionSnapshot": "engine.runtime.runner"}

__all__ = [
    "ContextLengthError", "DeviceError", "EngineError", "KNOWN_MODELS", "ModelConfig", "ModelFormatError", "ModelNotInstalledError",
    "Runner", "SessionSnapshot", "UnsupportedModelError", "available_models", "load_runner",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(import_module(module), name)
