"""`Generation`: one request as the worker sees it, and the events it sends back to the event loop."""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from server.grammar.compiler import CompiledGrammar
from server.reasoning.plan import ReasoningPlan
from server.sampling.params import SamplingParams


@dataclass(frozen=True)
class PositionLogprobs:
    """A token's logprob under the model and the most likely alternatives at its position."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(frozen=True)
class ChoiceDelta:
    """New output of choice `index`: text safe to send, the tokens behind it, and the finish reason once done."""

    index: int
    text: str
    tokens: list[int]
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # with finish "stop": the stop string or end-token id that ended it
    at: float = field(default_factory=time.perf_counter)  # when the worker made these tokens (latency metrics)
    reasoning: str = ""  # new thinking text (a reasoning model's; `text` is then the answer's alone)


def merged(deltas: list[ChoiceDelta]) -> ChoiceDelta:
    """Consecutive deltas of one choice as one: their text, tokens and logprobs in order, the last one's finish."""
    if len(deltas) == 1:
        return deltas[0]
    last = deltas[-1]
    logprobs = None if last.logprobs is None else [lp for d in deltas for lp in d.logprobs]
    return ChoiceDelta(last.index, "".join(d.text for d in deltas), [t for d in deltas for t in d.tokens], logprobs,
                       last.finish_reason, last.stop_reason, last.at, "".join(d.reasoning for d in deltas))


@dataclass(frozen=True)
class PromptLogprobs:
    """Logprobs of the prompt tokens (the first has none), for `echo` with `logprobs`."""

    entries: list[PositionLogprobs | None]


@dataclass(frozen=True)
class GenerationDone:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    reasoning_tokens: int = 0  # completion tokens spent thinking (every choice's)


@dataclass(frozen=True)
class GenerationFailed:
    status: int
    message: str
    code: str | None = None


Event = ChoiceDelta | PromptLogprobs | GenerationDone | GenerationFailed


class Submission:
    """What a Generation and an EmbeddingJob share: events back to their asyncio side (or their `sink`), and
    cancellation (told to `on_cancel`). Expects the fields `loop`, `channel`, `sink`, `on_cancel`, `_cancelled`."""

    loop: asyncio.AbstractEventLoop | None
    channel: asyncio.Queue[Any]
    sink: EventSink | None
    on_cancel: Callable[[Any], None] | None
    _cancelled: threading.Event

    def emit(self, event: Any) -> None:
        """Send an event to the asyncio side; safe to call from the worker thread."""
        hand_over(self.sink or self.loop, [(self, event)])

    def cancel(self) -> None:
        """Ask the worker to drop this at its next step (idempotent, any thread)."""
        self._cancelled.set()
        if self.on_cancel is not None:
            self.on_cancel(self)

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


@dataclass(eq=False)  # identity: the scheduler keys its state by Generation
class Generation(Submission):
    """Prompt ids, `n` choices with shared parameters, and a thread-safe channel back to the asyncio side.

    The generations of one request (one per prompt) share one `channel`, so that the serving layer reads all of
    them as they come: each item is (generation, event).
    """

    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    n: int = 1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: frozenset[int] = frozenset()
    min_tokens: int = 0
    ignore_eos: bool = False
    prompt_logprobs: int | None = None  # top-N for echoed prompt tokens; None: not wanted
    grammar: CompiledGrammar | None = None  # what every choice's output must match; None: free text
    # The model's thinking: split from the answer, the grammar held back until it ends, its budget; None: the
    # output is all answer.
    reasoning: ReasoningPlan | None = None
    request_id: str = ""
    prompt_index: int = 0               # which prompt of its request this is
    # Undelivered events past which the worker pauses this generation (a client that stops reading); None: never.
    max_backlog: int | None = None
    # Tokens a choice gathers into one ChoiceDelta past its first (the last goes out with the finish): fewer
    # events, chunks and socket writes per token when many streams run (--stream-interval); 0: the scheduler's
    # choice by load (Scheduler.auto_stream_interval).
    stream_interval: int = 1
    arrival: float = field(default_factory=time.perf_counter)  # when the request came in, for the latency metrics
    loop: asyncio.AbstractEventLoop | None = field(default_factory=asyncio.get_running_loop)
    channel: asyncio.Queue[tuple[Generation, Event]] = field(default_factory=asyncio.Queue)
    # Where the worker's events go instead of `channel` on `loop`: in the engine process (server/process/client.py),
    # the pipe to the HTTP process, which also says when the reader there is backlogged. None: in this process.
    sink: EventSink | None = None
    # Told of `cancel()`, on the canceller's thread: in the HTTP process, what forwards it to the engine process.
    on_cancel: Callable[[Generation], None] | None = None
    _cancelled: threading.Event = field(default_factory=threading.Event)

    @property
    def backlogged(self) -> bool:
        """Whether the reader is so far behind that the worker should not make more tokens for now (any thread:
        a deque's length is read atomically)."""
        if self.max_backlog is None:
            return False
        if self.sink is not None:
            return self.sink.backlogged(self)
        return self.channel.qsize() >= self.max_backlog


class EventSink(Protocol):
    """A destination for a generation's events other than its channel (see `Generation.sink`)."""

    def deliver(self, batch: list[tuple[Any, Any]]) -> None: ...

    def backlogged(self, gen: Generation) -> bool: ...


def _deliver(batch: list[tuple[Submission, Any]]) -> None:
    for sub, event in batch:
        sub.channel.put_nowait((sub, event))


def hand_over(target: asyncio.AbstractEventLoop | EventSink, batch: list[tuple[Submission, Any]]) -> None:
    """Events to their submissions' channels on event loop `target` (one wake-up for the batch; any thread), or
    to the sink `target`."""
    if isinstance(target, asyncio.AbstractEventLoop):
        target.call_soon_threadsafe(_deliver, batch)
    else:
        target.deliver(batch)


class EventBatch:
    """Events of one scheduler step, handed to each event loop in a single wake-up rather than one per token.

    On a small machine every cross-thread wake-up of the event loop competes with the model's threads for the
    cores; one per step instead of one per token and sequence keeps that cost flat as the batch grows.
    """

    def __init__(self) -> None:
        self._events: list[tuple[Generation, Event]] = []

    def emit(self, gen: Generation, event: Event) -> None:
        self._events.append((gen, event))

    def flush(self) -> None:
        by_loop: dict[asyncio.AbstractEventLoop | EventSink, list[tuple[Generation, Event]]] = {}
        for gen, event in self._events:
            by_loop.setdefault(gen.sink or gen.loop, []).append((gen, event))
        self._events = []
        for target, batch in by_loop.items():
            hand_over(target, batch)
