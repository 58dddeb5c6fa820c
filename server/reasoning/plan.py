"""`ReasoningPlan`: what a generation needs to know of its model's thinking, as plain data (it crosses the engine
process's pipe): the tags, their ids where single tokens, where the output starts, and the thinking budget."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Literal, get_args

from server.reasoning.formats import ReasoningFormat, opens_thinking

# The prompt's last tokens, decoded, tell whether the template opened the thinking (the generation prompt's end).
PROMPT_TAIL_TOKENS = 32
# The reasoning efforts (OpenAI's `reasoning_effort`, the Responses API's `reasoning.effort`) and their thinking
# budgets: tokens of thinking before the closing tag is forced; None: no limit.
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
EFFORT_BUDGETS: dict[str, int | None] = {"none": 0, "minimal": 0, "low": 512, "medium": 2048, "high": None,
                                         "xhigh": None, "max": None}
assert set(EFFORT_BUDGETS) == set(get_args(ReasoningEffort))


def efforts_described() -> str:
    """The efforts and their budgets, for the fields' descriptions: "none, minimal 0; low 512; ...; high, ... no
    limit"."""
    groups: dict[int | None, list[str]] = {}
    for name, budget in EFFORT_BUDGETS.items():
        groups.setdefault(budget, []).append(name)
    return "; ".join(f"{', '.join(names)} {'no limit' if budget is None else budget}"
                     for budget, names in groups.items())


class Phase(IntEnum):
    BEFORE = 0    # nothing but whitespace yet: the output may still open its thinking
    THINKING = 1
    ANSWER = 2


@dataclass(frozen=True)
class ReasoningPlan:
    start: str
    end: str
    start_id: int | None          # the opening tag's id, where it is one token
    end_id: int | None
    end_ids: tuple[int, ...]      # the closing tag as the tokens a spent budget forces
    starts_thinking: bool         # the prompt opened the thinking (the template wrote the opening tag)
    budget: int | None = None     # thinking tokens before the closing tag is forced; None: no limit

    @property
    def first_phase(self) -> Phase:
        return Phase.THINKING if self.starts_thinking else Phase.BEFORE


def single(ids: tuple[int, ...]) -> int | None:
    """A tag's id where it is one token (found by id), else None (found in the text)."""
    return ids[0] if len(ids) == 1 else None


def make_plan(fmt: ReasoningFormat, prompt_ids: Sequence[int], encode: Callable[[str], Sequence[int]],
              decode: Callable[[Sequence[int]], str], budget: int | None) -> ReasoningPlan:
    """A generation's plan: the format's tags (by id where single tokens), whether the prompt opened the thinking,
    and the budget."""
    start, end = tuple(encode(fmt.start)), tuple(encode(fmt.end))
    return ReasoningPlan(fmt.start, fmt.end, single(start), single(end), end,
                         opens_thinking(decode(prompt_ids[-PROMPT_TAIL_TOKENS:]), fmt), budget)
