"""The gate in front of a choice's grammar: everything allowed while the model thinks, only the closing tag once
the budget is spent, the grammar's mask before the thinking opens and after it ends, and rollbacks."""
from __future__ import annotations

import torch

from server.grammar.token_bitmask import bitmask_words
from server.reasoning.gate import ReasoningGate, choice_matcher
from server.reasoning.plan import Phase, ReasoningPlan

VOCAB = 40
THINK, END, BRACE = 3, 4, 7
TEXT = {THINK: "<think>", END: "</think>", BRACE: "{"}


def text_of(token: int) -> str:
    return TEXT.get(token, f"w{token} ")


class OnlyBrace:
    """A grammar that takes one "{" and is then complete."""

    vocab_size = VOCAB

    def __init__(self) -> None:
        self.taken: list[int] = []

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        words = bitmask.numpy()[row]
        words[:] = 0
        if not self.taken:
            words[BRACE >> 5] |= 1 << (BRACE & 31)

    def advance(self, token: int) -> bool:
        if self.taken or token != BRACE:
            return False
        self.taken.append(token)
        return True

    def rollback(self, num_tokens: int) -> bool:
        del self.taken[len(self.taken) - num_tokens:]
        return True

    def copy(self) -> OnlyBrace:
        other = OnlyBrace()
        other.taken = list(self.taken)
        return other

    @property
    def is_stopped(self) -> bool:
        return bool(self.taken)

    @property
    def is_accepting(self) -> bool:
        return bool(self.taken)

    @property
    def error(self) -> str | None:
        return None


def allowed(gate: ReasoningGate) -> set[int]:
    bitmask = torch.zeros((1, bitmask_words(VOCAB)), dtype=torch.int32)
    gate.fill_bitmask(bitmask, 0)
    words = bitmask.numpy().view("uint32")[0]
    return {t for t in range(VOCAB) if (int(words[t >> 5]) >> (t & 31)) & 1}


def plan(budget: int | None, starts_thinking: bool = False) -> ReasoningPlan:
    return ReasoningPlan("<think>", "</think>", THINK, END, (END,), starts_thinking, budget)


def test_the_budget_forces_the_closing_tag_then_the_grammar_takes_over() -> None:
    gate = ReasoningGate(plan(budget=2), OnlyBrace(), VOCAB, text_of)
    assert allowed(gate) == {BRACE, THINK}  # answer at once under the grammar, or think first
    assert gate.advance(THINK) and gate.phase is Phase.THINKING
    for token in (10, 11):
        assert allowed(gate) == set(range(VOCAB))  # the thinking is free text
        assert gate.advance(token)
    assert allowed(gate) == {END}  # spent: only the closing tag
    assert gate.advance(END) and gate.phase is Phase.ANSWER
    assert allowed(gate) == {BRACE} and not gate.is_stopped
    assert gate.advance(BRACE) and gate.is_stopped


def test_answering_at_once_goes_to_the_grammar() -> None:
    gate = ReasoningGate(plan(budget=None), OnlyBrace(), VOCAB, text_of)
    assert gate.advance(BRACE) and gate.phase is Phase.ANSWER and gate.is_stopped


def test_a_rollback_returns_to_the_state_before_the_undone_tokens() -> None:
    gate = ReasoningGate(plan(budget=2, starts_thinking=True), OnlyBrace(), VOCAB, text_of)
    gate.advance(10)
    before = (allowed(gate), gate.phase, gate.thought)
    copy = gate.copy()
    for token in (11, END, BRACE):
        assert gate.advance(token)
    assert gate.is_stopped
    assert gate.rollback(3)
    assert (allowed(gate), gate.phase, gate.thought) == before
    assert (allowed(copy), copy.phase, copy.thought) == before  # the copy never moved


def test_a_gate_only_where_there_is_a_grammar_to_hold_back_or_a_budget() -> None:
    inner = OnlyBrace()
    assert choice_matcher(None, inner, VOCAB, text_of) is inner
    assert choice_matcher(plan(budget=None), None, VOCAB, text_of) is None
    assert isinstance(choice_matcher(plan(budget=None), inner, VOCAB, text_of), ReasoningGate)
    assert isinstance(choice_matcher(plan(budget=8), None, VOCAB, text_of), ReasoningGate)


def test_a_closing_tag_of_several_tokens_is_forced_one_token_after_the_other() -> None:
    texts = {20: "</", 21: "think", 22: ">"}
    multi = ReasoningPlan("<think>", "</think>", None, None, (20, 21, 22), True, budget=1)
    gate = ReasoningGate(multi, None, VOCAB, lambda t: texts.get(t, "x"))
    gate.advance(10)
    for token in (20, 21, 22):
        assert allowed(gate) == {token}
        gate.advance(token)
    assert gate.phase is Phase.ANSWER and allowed(gate) == set(range(VOCAB))
