"""`OutputProcessor`: what a scheduler's sampled tokens become for their requests: text and stops (detokenizing,
stop strings, the grammar's end), output held to a stream interval, prompt logprobs, and each step's events."""
from __future__ import annotations

import enum
import logging
import time

import torch

from engine.model.batch import StepRow

from server.sampling.logprobs import token_logprobs
from server.scheduling.generation import (ChoiceDelta, EventBatch, Generation, GenerationDone, PromptLogprobs,
    PositionLogprobs)
from server.scheduling.sequence import GenerationState, HeldOutput, SequenceState

log = logging.getLogger("emberserve.scheduler")
# Generation.stream_interval 0: a chunk per token up to 2 * AUTO_STREAMS running sequences, then one more token a
# chunk per AUTO_STREAMS of them, at most AUTO_MAX_INTERVAL. Each chunk costs the event loop the same whatever its
# tokens, and the loop shares the GIL with this thread: at 128 streams one chunk a token is most of the server's
# time (bench/RESULTS.md, issue 13).
AUTO_STREAMS = 16
AUTO_MAX_INTERVAL = 16


def auto_stream_interval(running: int) -> int:
    """Tokens a chunk gathers when the generation leaves it to the load: `running` sequences decoding."""
    return min(AUTO_MAX_INTERVAL, max(1, running // AUTO_STREAMS))


class Outcome(enum.Enum):
    """What a token did to its sequence: it goes on, it finished, or its grammar failed (the generation fails)."""

    GOES_ON = 1
    FINISHED = 2
    GRAMMAR_FAILED = 3


class OutputProcessor:
    """Turns each sequence's tokens into its events (text, stops, held output, logprobs), sent once a step."""

    def __init__(self) -> None:
        self.events = EventBatch()
        self.interval = 1  # auto_stream_interval of the step whose tokens are being handed on

    def flush(self) -> None:
        """Send the events gathered since the last flush."""
        self.events.flush()

    def push(self, seq: SequenceState, token: int, logprob: float | None,
             top: list[tuple[int, float]] | None) -> Outcome:
        """The token's text and stops, and its event (or the token held to the stream interval)."""
        gen, stopper = seq.gen, seq.stopper
        text, finish, stop_reason = stopper.push(token)
        if finish is None and seq.matcher is not None:
            if not seq.matcher.advance(token):  # the mask allowed it: a grammar engine failure
                log.error("%s: the grammar refused token %d: %s", gen.request_id, token, seq.matcher.error)
                return Outcome.GRAMMAR_FAILED
            if seq.matcher.is_stopped:  # the output is complete: nothing but an end token could follow
                end = stopper.end()
                text, finish = text + end.text, end.finish_reason
        reasoning = ""
        if seq.splitter is not None:  # the thinking apart from the answer
            split = seq.splitter.push(token, text)
            if finish is not None:
                split += seq.splitter.finish()
            reasoning, text = split.reasoning, split.answer
        entry = PositionLogprobs(token, logprob, top or []) if seq.wants_logprobs else None
        interval = gen.stream_interval or self.interval
        held = seq.held
        if finish is None and interval > 1 and len(held.tokens) + 1 < interval and stopper.num_tokens > 1:
            # The first token goes at once (TTFT); then every stream_interval-th, with those held since.
            held.text.append(text)
            held.reasoning.append(reasoning)
            held.tokens.append(token)
            if entry is not None:
                held.logprobs.append(entry)
            held.at = time.perf_counter()
        else:
            if held.tokens:
                text, tokens = "".join(held.text) + text, held.tokens
                reasoning = "".join(held.reasoning) + reasoning
                tokens.append(token)
                logprobs = None
                if entry is not None:
                    logprobs = held.logprobs
                    logprobs.append(entry)
                seq.held = HeldOutput()
            else:
                tokens, logprobs = [token], None if entry is None else [entry]
            self.events.emit(gen, ChoiceDelta(seq.choice, text, tokens, logprobs, finish, stop_reason,
                                              reasoning=reasoning))
        return Outcome.GOES_ON if finish is None else Outcome.FINISHED

    def release_held(self, seq: SequenceState) -> None:
        """Send what the sequence holds back (its generation is failing: what was produced goes out first)."""
        if seq.held.tokens:
            self.events.emit(seq.gen, seq.held.delta(seq.choice, seq.wants_logprobs))
            seq.held = HeldOutput()

    def collect_prompt_logprobs(self, seq: SequenceState, row: StepRow, logits: torch.Tensor) -> None:
        """Logprobs of the prompt tokens after each position of the chunk (row i predicts token start + i + 1)."""
        top_n = seq.gen.prompt_logprobs or 0
        if row.start == 0:
            seq.prompt_logprobs.append(None)  # the first token has no context to be predicted from
        targets = seq.kv.tokens[row.start + 1:row.end + 1]  # the last chunk's last row predicts no prompt token
        if not targets:
            return
        ids = torch.tensor(targets, dtype=torch.long, device=logits.device)
        chosen, top = token_logprobs(logits[:len(targets)], ids, top_n)
        for i, token in enumerate(targets):
            seq.prompt_logprobs.append(PositionLogprobs(token, chosen[i], top[i]))

    def prompt_done(self, seq: SequenceState) -> None:
        """The prompt is computed: its logprobs go out, where asked for (echo)."""
        if seq.gen.prompt_logprobs is not None:
            self.events.emit(seq.gen, PromptLogprobs(seq.prompt_logprobs))

    def empty_choices(self, gen: Generation) -> None:
        """max_tokens 0 (echo only): every choice ends at once with no tokens."""
        for index in range(gen.n):
            self.events.emit(gen, ChoiceDelta(index, "", [], [] if gen.params.logprobs else None, "length"))

    def done(self, gen: Generation, state: GenerationState) -> None:
        """The generation's last event: its usage."""
        self.events.emit(gen, GenerationDone(state.prompt_tokens, state.completion_tokens, state.cached_tokens,
                                             state.reasoning_tokens))
