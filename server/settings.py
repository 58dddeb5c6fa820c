"""`Settings`: everything the server is started with, from the command line."""
from __future__ import annotations

from dataclasses import dataclass

from engine.registry import DEFAULT_MODEL

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000


@dataclass(frozen=True)
class Settings:
    model: str = DEFAULT_MODEL            # a known model name, a .gguf file or a safetensors directory
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    device: str = "cpu"
    dtype: str | None = None              # None: float32 on CPU, bfloat16 on accelerators
    max_context: int | None = None        # cap below the model's trained context
    served_model_name: str | None = None  # the id clients send as `model`; default: the model's name
    log_level: str = "info"
