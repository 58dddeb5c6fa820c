"""Weight readers (GGUF, safetensors) and what they share."""
from __future__ import annotations

from collections.abc import Callable

# `progress(stage, done, total)`: told as a load advances (a tensor read, a module packed).
Progress = Callable[[str, int, int], None]


def no_progress(stage: str, done: int, total: int) -> None:
    """The default: nobody is told."""
