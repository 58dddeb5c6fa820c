"""The OpenAI-compatible HTTP server on top of the engine."""

__version__ = "0.1.0"
