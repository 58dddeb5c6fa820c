"""emberserve's engine: loads models and computes logits; knows nothing of HTTP."""
from engine.config import ModelConfig
from engine.errors import (ContextLengthError, EngineError, ModelFormatError, ModelNotInstalledError,
    UnsupportedModelError)
from engine.loader.load import load_runner
from engine.registry import KNOWN_MODELS, available_models
from engine.runtime.runner import Runner, SessionSnapshot

__all__ = [
    "ContextLengthError", "EngineError", "KNOWN_MODELS", "ModelConfig", "ModelFormatError", "ModelNotInstalledError",
    "Runner", "SessionSnapshot", "UnsupportedModelError", "available_models", "load_runner",
]
