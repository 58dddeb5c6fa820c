"""What crosses the pipe between the HTTP process and the engine process (server/engine_process.py): the served
model's facts, submissions as dicts of their fields, and events, the frequent ChoiceDelta as a plain tuple (a
tenth of a pickled dataclass's bytes, and cheaper both ways)."""
from __future__ import annotations

from dataclasses import fields
from typing import Any


from server.scheduling.embedding_jobs import EmbeddingJob
from server.scheduling.generation import ChoiceDelta, Generation, PromptLogprobs, TokenLogprob


# What stays in its process: the asyncio side, the event sink, the cancellation hook and flag; and the compiled
# grammar, whose matcher cannot travel (its spec does, compiled again in the engine process).
_LOCAL_FIELDS = {"loop", "channel", "sink", "on_cancel", "_cancelled", "grammar"}
GENERATION_FIELDS = tuple(f.name for f in fields(Generation) if f.name not in _LOCAL_FIELDS)
JOB_FIELDS = tuple(f.name for f in fields(EmbeddingJob) if f.name not in _LOCAL_FIELDS)


def encode_event(event: Any) -> Any:
    if type(event) is ChoiceDelta:
        logprobs = None if event.logprobs is None else [(lp.token, lp.logprob, lp.top) for lp in event.logprobs]
        return (event.index, event.text, event.tokens, logprobs, event.finish_reason, event.stop_reason, event.at)
    return event  # the rare ones (prompt logprobs, done, failed, embeddings) pickle as they are


def decode_event(item: Any) -> Any:
    if type(item) is not tuple:
        return item
    index, text, tokens, logprobs, finish, stop, at = item
    if logprobs is not None:
        logprobs = [TokenLogprob(token, logprob, top) for token, logprob, top in logprobs]
    return ChoiceDelta(index, text, tokens, logprobs, finish, stop, at)


def is_final(event: Any) -> bool:
    """The last event a submission gets (a Generation's done or failure, an embedding job's one result)."""
    return not isinstance(event, (ChoiceDelta, PromptLogprobs))
