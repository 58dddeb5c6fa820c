"""The OpenAI-compatible HTTP server on top of the engine, and the same serving stack in-process (`Generator`)."""
from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

# The Python API, imported on first use: `import server.config.settings` (the CLI, the tests) need not load the app.
_PUBLIC = {
    "Generator": "generator.generator", "GenerationConfig": "generator.generator",
    "GeneratedText": "generator.generator", "GenerationError": "generator.generator",
    "StreamedToken": "generator.generator", "GeneratorBuilder": "generator.generator", "SyncGenerator": "generator.generator",
    "available_models": "config.model_catalog", "suggested_models": "config.model_catalog",
    "model_info": "config.model_catalog", "ModelInfo": "config.model_catalog",
    "is_generator_model": "config.model_catalog", "PRESETS": "config.presets", "Preset": "config.presets",
    "list_models": "config.model_catalog", "pull_model": "config.model_store", "remove_model": "config.model_store",
    "show_model": "generator.model_card", "ModelCard": "generator.model_card",
}
__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'server' has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(f".{module}", __name__), name)
