"""`SequenceState`: one sequence the scheduler runs (a generation's prompt, or one of its choices), and
`GenerationState`, what the scheduler counts for a generation across its sequences."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.cache.block_manager import KVSequence

from server.grammar.compiler import GrammarMatcher
from server.reasoning.gate import ReasoningGate
from server.reasoning.harmony import HarmonySplitter
from server.reasoning.splitter import ReasoningSplitter
from server.sampling.sampler import SequenceSampler
from server.scheduling.generation import ChoiceDelta, Generation, PositionLogprobs
from server.scheduling.stopping import StopChecker


@dataclass(eq=False)
class HeldOutput:
    """A choice's output not sent yet (gathered up to its generation's stream_interval), kept as its parts: one
    ChoiceDelta is made when it goes, rather than one a token and their merge."""

    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    at: float = 0.0  # when its last token was made

    def delta(self, choice: int | None, logprobs: bool) -> ChoiceDelta:
        """All of it as one delta (the last token's time, no finish)."""
        return ChoiceDelta(choice, "".join(self.text), self.tokens, self.logprobs if logprobs else None, at=self.at,
                           reasoning="".join(self.reasoning))


@dataclass(eq=False)
class SequenceState:
    """A sequence the scheduler runs: a Generation's prompt (choice None) or one of its choices."""

    gen: Generation
    kv: KVSequence
    choice: int | None = None
    sampler: SequenceSampler | None = None
    stopper: StopChecker | None = None
    # The choice's place in its grammar (gen.grammar); it moves with the sequence through preemption, which keeps
    # the generated tokens too.
    matcher: GrammarMatcher | ReasoningGate | None = None
    # Splits the choice's text into its thinking and its answer (a reasoning model's output).
    splitter: ReasoningSplitter | HarmonySplitter | None = None
    prompt_logprobs: list[PositionLogprobs | None] = field(default_factory=list)
    held: HeldOutput = field(default_factory=HeldOutput)
    # Out of the batch for good (its blocks freed): a row of it in a step already launched is dropped.
    finished: bool = False
    # What the generation asks that the sequence's every step looks at, fixed once here rather than read through
    # `gen` per token: a prompt whose every position's logprob is asked for (echo with logprobs); each token's
    # logprobs; end tokens kept from being sampled until min_tokens.
    wants_prompt_logprobs: bool = field(init=False)
    wants_logprobs: bool = field(init=False)
    suppresses_early_ends: bool = field(init=False)

    def __post_init__(self) -> None:
        gen = self.gen
        self.wants_prompt_logprobs = self.choice is None and gen.prompt_logprobs is not None
        self.wants_logprobs = bool(gen.params.logprobs)
        self.suppresses_early_ends = gen.min_tokens > 0 and not gen.ignore_eos

    @property
    def slots(self) -> int:
        """Running sequences this one stands for: its `n` choices once a prompt forks."""
        return self.gen.n if self.choice is None else 1


@dataclass(eq=False)
class GenerationState:
    """A generation's counts across its sequences: its usage, its choices still open, whether it started."""

    prompt_tokens: int
    cached_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    open_choices: int = 0
    started: bool = False  # its prompt was admitted to the running batch once
