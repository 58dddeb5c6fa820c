"""`Settings`: everything the server is started with, from the command line."""
from __future__ import annotations

import re
from dataclasses import dataclass

from engine.registry import DEFAULT_MODEL

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1000**3, "gb": 1000**3, "gib": 1024**3}


def parse_bytes(text: str) -> int:
    """'1GiB', '512MiB', '2G', '1000000' → bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a memory size: {text!r} (use e.g. 512MiB, 2GiB, or bytes)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass(frozen=True)
class Settings:
    model: str = DEFAULT_MODEL            # a known model name, a .gguf file or a safetensors directory
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    device: str = "cpu"
    dtype: str | None = None              # None: bfloat16 (float32 for an unquantized model on CPU)
    quant: str | None = None              # none/int8/int4; None: int4 for a quantized (GGUF) model on CPU
    max_context: int | None = None        # cap below the model's trained context
    served_model_name: str | None = None  # the id clients send as `model`; default: the model's name
    log_level: str = "info"
    workers: int = 1                      # runners, each on its own thread (and device, on a multi-GPU host)
    max_queued: int = 256                 # waiting requests per worker before answering 429
    max_running: int = 32                 # sequences decoding together in one batch
    max_batched_tokens: int = 512         # tokens per forward pass; longer prompts are prefilled in chunks
    kv_cache_memory: int | None = None    # bytes for the paged KV pool; None: the engine's default
    prefix_caching: bool = True
