"""`ReasoningGate`: a choice's grammar held back while the model thinks, and its thinking budget.

It stands where the grammar's matcher does (the scheduler's masks, speculative drafts' masks, the output
processor's advance and rollback), so structured outputs, forced tool calls and budgets need nothing else:

- before the output has opened its thinking, the grammar's mask plus the opening tag (one token) is allowed: the
  model may think first, or answer at once under the grammar;
- while it thinks, every token is allowed (the thinking is free text) until the budget is spent; from then on
  only the closing tag's tokens, one after the other, as llama-server's reasoning budget does;
- after the closing tag, the grammar (if any) takes every token, from its start.

For harmony output (server/reasoning/harmony.py) "thinking" is everything before the final channel's text (the
analysis, preambles, headers), the closing tag is `<|end|><|start|>assistant<|channel|>final<|message|>`, and a grammar
that holds the whole output (a call forced by tool_choice, `plan.grammar_first`) needs no gate.
"""
from __future__ import annotations

import copy
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from server.reasoning.harmony import HarmonySplitter, new_splitter
from server.reasoning.plan import Phase, ReasoningPlan
from server.reasoning.splitter import ReasoningSplitter


# Tokens a rollback may undo: more than any speculative draft verifies in one step.
UNDO_TOKENS = 64


class TokenMatcher(Protocol):
    """What the gate needs of a grammar's matcher (server/grammar/compiler.py: GrammarMatcher)."""

    vocab_size: int

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None: ...
    def advance(self, token: int) -> bool: ...
    def rollback(self, num_tokens: int) -> bool: ...
    def copy(self) -> TokenMatcher: ...
    @property
    def is_stopped(self) -> bool: ...
    @property
    def is_accepting(self) -> bool: ...
    @property
    def error(self) -> str | None: ...


@dataclass
class _State:
    """What a token changed besides the splitter (whose copy before the token is kept beside it)."""

    thought: int          # thinking tokens so far
    forced: int           # closing-tag tokens forced so far
    to_grammar: bool      # whether the token went to the grammar (to undo it there)


# The masks are written through numpy: they are filled on the mask thread, outside the step's inference mode,
# into a tensor that may have been made inside it.
def _only(bitmask: torch.Tensor, row: int, token: int) -> None:
    words = bitmask.numpy()[row]
    words[:] = 0
    _allow(bitmask, row, token)


def _allow(bitmask: torch.Tensor, row: int, token: int) -> None:
    words = bitmask.numpy()[row].view(np.uint32)
    words[token >> 5] |= np.uint32(1 << (token & 31))


def _allow_all(bitmask: torch.Tensor, row: int) -> None:
    bitmask.numpy()[row] = -1


class ReasoningGate:
    """One choice's matcher: its grammar (`inner`, or None) behind its thinking."""

    def __init__(self, plan: ReasoningPlan, inner: TokenMatcher | None, vocab_size: int,
                 token_text: Callable[[int], str]) -> None:
        self.plan, self.inner, self.vocab_size, self.token_text = plan, inner, vocab_size, token_text
        self.splitter = new_splitter(plan)
        self.thought = 0
        self.forced = 0
        # The last tokens' states, for speculative decoding's rollbacks (a few tokens at a time).
        self._undo: deque[tuple[_State, ReasoningSplitter | HarmonySplitter | None]] = deque(maxlen=UNDO_TOKENS)

    @property
    def phase(self) -> Phase:
        return self.splitter.phase

    @property
    def forcing(self) -> bool:
        budget = self.plan.budget
        return self.phase is Phase.THINKING and budget is not None and self.thought >= budget

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        phase = self.phase
        if phase is Phase.ANSWER or (phase is Phase.BEFORE and self.inner is not None):
            if self.inner is None:
                _allow_all(bitmask, row)
                return
            self.inner.fill_bitmask(bitmask, row)
            if phase is Phase.BEFORE and self.plan.start_id is not None:
                _allow(bitmask, row, self.plan.start_id)
        elif self.forcing:
            _only(bitmask, row, self.plan.end_ids[min(self.forced, len(self.plan.end_ids) - 1)])
        else:
            _allow_all(bitmask, row)

    def advance(self, token: int) -> bool:
        phase = self.phase
        state = _State(self.thought, self.forced, False)
        if phase is Phase.ANSWER or (phase is Phase.BEFORE and self.inner is not None and token != self.plan.start_id):
            self._undo.append((state, None if phase is Phase.ANSWER else copy.copy(self.splitter)))
            if phase is Phase.BEFORE:
                self.splitter.phase = Phase.ANSWER
            if self.inner is None:
                return True
            state.to_grammar = True
            return self.inner.advance(token)
        self._undo.append((state, copy.copy(self.splitter)))
        if self.forcing:
            self.forced += 1
        if self.phase is Phase.THINKING:
            self.thought += 1
        self.splitter.push(token, self.token_text(token))
        if self.forced >= len(self.plan.end_ids) and self.phase is Phase.THINKING and self.forcing:
            self.splitter.phase = Phase.ANSWER  # the closing tag was written as text split across tokens
        return True

    def rollback(self, num_tokens: int) -> bool:
        if num_tokens > len(self._undo):
            return False
        for _ in range(num_tokens):
            state, splitter = self._undo.pop()
            if state.to_grammar and self.inner is not None and not self.inner.rollback(1):
                return False
            if splitter is not None:
                self.splitter = splitter
            self.thought, self.forced = state.thought, state.forced
        return True

    def copy(self) -> ReasoningGate:
        other = ReasoningGate(self.plan, self.inner.copy() if self.inner is not None else None, self.vocab_size,
                              self.token_text)
        other.splitter, other.thought, other.forced = copy.copy(self.splitter), self.thought, self.forced
        other._undo = deque(self._undo, maxlen=UNDO_TOKENS)
        return other

    @property
    def is_stopped(self) -> bool:
        return self.phase is Phase.ANSWER and self.inner is not None and self.inner.is_stopped

    @property
    def is_accepting(self) -> bool:
        return self.phase is Phase.ANSWER and (self.inner is None or self.inner.is_accepting)

    @property
    def error(self) -> str | None:
        return self.inner.error if self.inner is not None else None


def choice_matcher(plan: ReasoningPlan | None, inner: TokenMatcher | None, vocab_size: int,
                   token_text: Callable[[int], str]) -> TokenMatcher | ReasoningGate | None:
    """What stands for a choice's grammar: the grammar's own matcher, or a gate in front of it where the model's
    thinking comes first and there is a grammar to hold back or a budget to keep (else nothing: free text)."""
    if plan is None or (inner is None and plan.budget is None) or plan.grammar_first:
        return inner
    return ReasoningGate(plan, inner, vocab_size, token_text)
