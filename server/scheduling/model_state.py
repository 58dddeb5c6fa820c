"""What serving knows of the served model: its facts (`ServedModel`, also all the HTTP side has of an engine in
another process), the pool its requests go to (`Pool`: the worker pool here, or the engine process's client), and
`ModelState`, which the API's serving classes and the in-process `Generator` serve from."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from engine.tokenizer.tokenizer import Tokenizer
from engine.weights.summary import WeightsSummary

from server.config.presets import Preset
from server.grammar.compiler import GrammarCompiler
from server.reasoning.formats import ReasoningFormat
from server.scheduling.embedding_jobs import EmbeddingJob
from server.scheduling.generation import Generation


@dataclass(frozen=True)
class PoolStats:
    """The pool's load, KV-cache and speculation figures, summed over its workers: GET /health's body (`Health`,
    server/api/openai/protocol.py, has a field of the same name for each) and GET /metrics's pool figures
    (server/api/metrics.py). Crosses the engine process's pipe as it is. All zero (and no speculation) while no
    figures were read yet."""

    running: int = 0                       # sequences' requests in the running batches
    queued: int = 0                        # submitted, waiting to run
    generated_tokens: int = 0              # since start
    kv_blocks_total: int = 0               # KV-cache blocks (0: an encoder, which has none)
    kv_blocks_used: int = 0                # in use (cached but unreferenced blocks count as free)
    prefix_cache_queried_tokens: int = 0   # prompt tokens looked up in the prefix cache, since start
    prefix_cache_hit_tokens: int = 0       # prompt tokens found there, since start
    preemptions: int = 0                   # sequences preempted for lack of KV blocks, since start
    speculative: str | None = None         # the speculative decoding method in force ("ngram", "draft"), if any
    # speculative decoding's figures, as vLLM's spec_decode metrics name them
    spec_decode_num_drafts: int = 0        # sequence steps that verified drafted tokens
    spec_decode_num_draft_tokens: int = 0  # tokens drafted
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # by position in the draft
    spec_decode_acceptance_rate: float | None = None         # accepted / drafted tokens; None before any draft
    spec_decode_mean_acceptance_length: float | None = None  # 1 + accepted / drafts; None before any draft


class Pool(Protocol):
    """Where serving sends its work: `WorkerPool` (the workers in this process) or `EngineClient` (the engine
    process's, over a pipe). Serving codes against this and nothing else."""

    max_queued: int

    @property
    def failure(self) -> str | None:
        """Why the engine stopped serving, or None while it serves."""

    def submit(self, sub: Generation | EmbeddingJob) -> None:
        """Queue a generation or an embedding job (an APIError: queue full, or the engine has failed)."""

    def stats(self) -> PoolStats:
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
    """What the HTTP side reads of the first worker's runner (`ModelState.model`: in the engine process mode all the HTTP process has)."""

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
    weights: WeightsSummary | None  # what its files say: parameter count, file type, trained context, size
    chat_tuned: bool

    @classmethod
    def of(cls, runner: Any) -> ServedModel:
        blocks = None if runner.blocks is None else CacheLayout(runner.blocks.block_size, runner.blocks.prefix_caching)
        return cls(runner.name, runner.family, runner.device, runner.dtype, runner.quant, runner.deterministic,
                   runner.context_size, runner.vocab_size, runner.is_encoder, runner.embedding_size,
                   dict(runner.generation_defaults), runner.tokenizer, blocks, runner.weights, runner.chat_tuned)


@dataclass
class ModelState:
    """The served model: its id, runner and worker."""

    model_id: str
    model: ServedModel  # the served model's facts (all the HTTP side has of an engine in another process)
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
    max_tokens_default: int | None = None  # a request's output budget when it and its presets set none
    reasoning: ReasoningFormat | None = None  # how the model's thinking is told from its answer; None: it is not
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # every render's variables (--chat-template-kwargs)
