"""Errors the engine raises with a message meant for the user."""
from __future__ import annotations

from dataclasses import dataclass


class EngineError(Exception):
    """Base of every error the engine reports to its caller."""


class ModelFormatError(EngineError):
    """A model file or directory is missing, truncated, or in a format we cannot read."""


class UnsupportedModelError(EngineError):
    """The model is readable but uses an architecture or tensor type the engine does not implement."""


class DeviceError(EngineError):
    """A device that this machine does not have (or a name that is no device)."""


class ModelNotInstalledError(EngineError):
    """A known model name whose package is not installed; the message says how to install it."""


class ModelNotPulledError(ModelNotInstalledError):
    """A Hugging Face model name (`owner/repo[:QUANT]`) not in the local Hub cache; the message says how to pull it."""


class ModelDownloadError(EngineError):
    """Pulling a model from the Hugging Face Hub failed: the repo, the files, the network or a checksum."""


class ContextLengthError(EngineError, ValueError):
    """A sequence would grow past the runner's context size."""


@dataclass(frozen=True)
class RowRefusal:
    """Why a row cannot run: the message, and a code the server reports with it as data
    (`CONTEXT_LENGTH_EXCEEDED` for a sequence past the context; None for a row that is the caller's mistake)."""

    message: str
    code: str | None = None

    def __str__(self) -> str:
        return self.message


CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


class RowError(EngineError, ValueError):
    """Rows of a batched step that cannot run, by their index in the step (index -> why); nothing was changed."""

    def __init__(self, errors: dict[int, RowRefusal]) -> None:
        super().__init__("; ".join(f"row {i}: {refusal}" for i, refusal in sorted(errors.items())))
        self.errors = errors
