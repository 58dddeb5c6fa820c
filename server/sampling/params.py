"""A sequence's sampling parameters and the API's limits on them: the one place a request's values are checked
(token ids in range, logit_bias entries, top_logprobs), without torch, so the request models and the command line
import it alone. The sampler that applies them is server.sampling.sampler."""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

# The limits the API states (OpenAI's numbers).
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # a request's logit_bias value lies in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS]
# vLLM's _SAMPLING_EPS: a temperature below it samples greedily.
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """One sequence's sampling parameters (OpenAI names; server.sampling.sampler's docstring has their semantics)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (both disable it) or positive, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs")
        bias: dict[int, float] = {}
        for token, value in self.logit_bias.items():
            try:
                token_id, value = logit_bias_entry(token, value)
            except ValueError as e:
                raise ValueError(f"logit_bias {e}") from None
            bias[token_id] = value
        # A private copy: the caller's dict may change after the request was accepted.
        object.__setattr__(self, "logit_bias", bias)

    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


def out_of_vocabulary(ids: Iterable[int], vocab_size: int) -> list[int]:
    """The ids outside [0, vocab_size), in order: the one token-id range rule (the API's 400s and the sampler's
    checks both apply it)."""
    return [t for t in ids if not 0 <= t < vocab_size]


def logit_bias_entry(token: object, value: float, limit: float = math.inf) -> tuple[int, float]:
    """One logit_bias entry as (token id, bias): the one rule for its key (a token id, or its decimal text) and its
    value (a finite number within [-limit, limit]); ValueError otherwise."""
    if isinstance(token, str) and token.lstrip("-").isdigit():
        token_id = int(token)
    elif isinstance(token, int) and not isinstance(token, bool):
        token_id = token
    else:
        raise ValueError(f"keys must be token ids, got {token!r}")
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"bias for token {token} must be a finite number, got {value}")
    if not -limit <= value <= limit:
        raise ValueError(f"bias for token {token} must be between -{limit:g} and {limit:g}, got {value}")
    return token_id, float(value)
