"""What serving knows of the served model: its facts (`ServedModel`, also all the HTTP side has of an engine in
another process), the pool its requests go to (`Pool`: the worker pool here, or the engine process's client), and
`ModelState`, which the API's serving classes and the in-process `Generator` serve from."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from engine import Runner
from engine.tokenizer.tokenizer import Tokenizer

from server.config.presets import Preset
from server.grammar.compiler import GrammarCompiler
from server.scheduling.embedding_jobs import EmbeddingJob
from server.scheduling.generation import Generation


class Pool(Protocol):
    """Where serving sends its work: `WorkerPool` (the workers in this process) or `EngineClient` (the engine
    process's, over a pipe). Serving codes against this and nothing else."""

    max_queued: int

    @property
    def failure(self) -> str | None:
        """Why the engine stopped serving, or None while it serves."""

    def submit(self, sub: Generation | EmbeddingJob) -> None:
        """Queue a generation or an embedding job (an APIError: queue full, or the engine has failed)."""

    def stats(self) -> dict[str, Any]:
        """The latest load, KV-cache and speculation figures."""

    async def refresh_stats(self) -> None:
        """Bring `stats` up to date (a call to the engine process; nothing to do in this one)."""

    def stop(self) -> None:
        """Stop serving: the workers (or the engine process) end."""


@dataclass(frozen=True)
class CacheLayout:
    """What the HTTP side reads of the KV block manager."""

    block_size: int
    prefix_caching: bool


@dataclass(frozen=True)
class ServedModel:
    """What the HTTP side reads of the first worker's runner (`ModelState.runner` in the HTTP process)."""

    name: str
    family: str
    device: torch.device
    dtype: torch.dtype
    quant: str
    deterministic: bool
    context_size: int
    vocab_size: int
    is_encoder: bool
    embedding_size: int
    generation_defaults: dict[str, Any]
    tokenizer: Tokenizer
    blocks: CacheLayout | None

    @classmethod
    def of(cls, runner: Any) -> ServedModel:
        blocks = None if runner.blocks is None else CacheLayout(runner.blocks.block_size, runner.blocks.prefix_caching)
        return cls(runner.name, runner.family, runner.device, runner.dtype, runner.quant, runner.deterministic,
                   runner.context_size, runner.vocab_size, runner.is_encoder, runner.embedding_size,
                   dict(runner.generation_defaults), runner.tokenizer, blocks)


@dataclass
class ModelState:
    """The served model: its id, runner and worker."""

    model_id: str
    runner: Runner | ServedModel  # the first worker's runner (the engine process's: its facts)
    pool: Pool
    fingerprint: str
    created: int
    max_prompt_tokens: int | None = None  # the operator's cap on prompt length, below the context
    stream_timeout: float | None = None   # seconds a stream waits for a client that stopped reading, then is cut
    stream_interval: int = 0              # tokens a choice gathers into one event (Generation.stream_interval)
    parse_special_in_messages: bool = False  # trusted callers: special-token text in messages is control tokens
    grammars: GrammarCompiler | None = None  # compiled output grammars (structured outputs, tool calls), cached
    embeddings: bool = False              # serves POST /v1/embeddings (an encoder always; a decoder with --embeddings)
    pooling: str | None = None            # the embeddings' pooling (None: the runner's own)
    preset: Preset | None = None          # the server's preset (--preset): requests start from its values
