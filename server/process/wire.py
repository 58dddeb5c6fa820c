"""What crosses the pipe between the HTTP process (server/process/client.py) and the engine process
(server/process/engine.py): the messages' kinds (`ToEngine`, `ToClient`), the served model's facts, submissions as
dicts of their fields, and events, the frequent ChoiceDelta as a plain tuple (a tenth of a pickled dataclass's
bytes, and cheaper both ways).

A message is a tuple `(kind, *payload)` whose kind is the enum member's plain string value (`.value`): a pickled
enum member costs twice the bytes of a short string, on every step's events message. A StrEnum member equals and
hashes as its value, so either side's handler table (keyed by the members) looks a received string up as it is.
The HTTP process writes its messages for the engine in batches (a list of them per write); the engine writes one
message per write."""
from __future__ import annotations

from dataclasses import fields
from enum import StrEnum
from typing import Any

from server.scheduling.embedding_jobs import EmbeddingJob
from server.scheduling.generation import ChoiceDelta, Generation, PromptLogprobs, PositionLogprobs


class ToEngine(StrEnum):
    """What the HTTP process sends the engine process (the payload after the kind)."""

    GENERATE = "generate"  # (id, the Generation's GENERATION_FIELDS as a dict, its grammar a GrammarSpec or None)
    EMBED = "embed"        # (id, the EmbeddingJob's JOB_FIELDS as a dict)
    CANCEL = "cancel"      # (id): drop the submission; nothing more comes back for it
    BACKLOG = "backlog"    # (id, paused): its reader fell behind (True) or caught up (False)
    STATS = "stats"        # (call id): answered by a REPLY with the pool's PoolStats
    STORE = "store"        # (call id, "get" | "put" | "delete", key, value): answered by a REPLY with the result
    STOP = "stop"          # (): stop serving this pipe (the main HTTP process's: stop the engine)


class ToClient(StrEnum):
    """What the engine process sends an HTTP process (the payload after the kind)."""

    READY = "ready"              # (ServedModel): the model is loaded (the main HTTP process's pipe, first message)
    LOAD_FAILED = "load_failed"  # (reason): the model cannot load (instead of READY); the engine process exits
    EVENTS = "events"            # ([(id, encode_event(event)), ...]): one scheduler step's events
    REPLY = "reply"              # (call id, value): the answer to a STATS or STORE call
    FAILED = "failed"            # (reason): a worker stopped serving; the engine fails what it held itself


# What stays in its process: the asyncio side, the event sink, the cancellation hook and flag; and the compiled
# grammar, whose matcher cannot travel (its spec does, compiled again in the engine process).
_LOCAL_FIELDS = {"loop", "channel", "sink", "on_cancel", "_cancelled", "grammar"}
GENERATION_FIELDS = tuple(f.name for f in fields(Generation) if f.name not in _LOCAL_FIELDS)
JOB_FIELDS = tuple(f.name for f in fields(EmbeddingJob) if f.name not in _LOCAL_FIELDS)


def encode_event(event: Any) -> Any:
    if type(event) is ChoiceDelta:
        logprobs = None if event.logprobs is None else [(lp.token, lp.logprob, lp.top) for lp in event.logprobs]
        return (event.index, event.text, event.tokens, logprobs, event.finish_reason, event.stop_reason, event.at,
                event.reasoning)
    return event  # the rare ones (prompt logprobs, done, failed, embeddings) pickle as they are


def decode_event(item: Any) -> Any:
    if type(item) is not tuple:
        return item
    index, text, tokens, logprobs, finish, stop, at, reasoning = item
    if logprobs is not None:
        logprobs = [PositionLogprobs(token, logprob, top) for token, logprob, top in logprobs]
    return ChoiceDelta(index, text, tokens, logprobs, finish, stop, at, reasoning)


def is_final(event: Any) -> bool:
    """The last event a submission gets (a Generation's done or failure, an embedding job's one result)."""
    return not isinstance(event, (ChoiceDelta, PromptLogprobs))
