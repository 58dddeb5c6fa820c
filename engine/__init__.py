"""emberserve's engine: loads models and computes logits; knows nothing of HTTP."""
from .config import ModelConfig
from .errors import (ContextLengthError, EngineError, ModelFormatError, ModelNotInstalledError,
                     UnsupportedModelError)
from .loader import load_runner
from .registry import KNOWN_MODELS, available_models
from .runner import Runner, SessionSnapshot

__all__ = [
    "ContextLengthError", "EngineError", "KNOWN_MODELS", "ModelConfig", "ModelFormatError", "ModelNotInstalledError",
    "Runner", "SessionSnapshot", "UnsupportedModelError", "available_models", "load_runner",
]
