"""`ReasoningPlan`: what a generation needs to know of its model's thinking, as plain data (it crosses the engine
process's pipe): the tags, their ids where single tokens, where the output starts, and the thinking budget; for the
harmony format, its control tokens' ids, the message the prompt left open and what the output's calls become."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Literal, get_args

from server.reasoning.formats import HARMONY_TOKENS, ReasoningFormat, opens_thinking

# The prompt's last tokens, decoded, tell whether the template opened the thinking (the generation prompt's end).
PROMPT_TAIL_TOKENS = 32
# The reasoning efforts (OpenAI's `reasoning_effort`, the Responses API's `reasoning.effort`) and their thinking
# budgets: tokens of thinking before the closing tag is forced; None: no limit.
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
EFFORT_BUDGETS: dict[str, int | None] = {"none": 0, "minimal": 0, "low": 512, "medium": 2048, "high": None,
                                         "xhigh": None, "max": None}
assert set(EFFORT_BUDGETS) == set(get_args(ReasoningEffort))
# The efforts a harmony template (gpt-oss's "Reasoning: low | medium | high") knows, for every effort a request may
# name: the model's own control of its thinking, which takes the place of a budget.
HARMONY_EFFORTS: dict[str, str] = {"none": "low", "minimal": "low", "low": "low", "medium": "medium", "high": "high",
                                   "xhigh": "high", "max": "high"}
assert set(HARMONY_EFFORTS) == set(get_args(ReasoningEffort))


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
class HarmonyIds:
    """The ids of harmony's control tokens."""

    start: int
    end: int
    message: int
    channel: int
    constrain: int
    return_: int
    call: int

    def text(self, token: int) -> str | None:
        """A control token's text, or None for any other token."""
        for name, spelt in zip(("start", "end", "message", "channel", "constrain", "return_", "call"),
                               HARMONY_TOKENS):
            if getattr(self, name) == token:
                return spelt
        return None


@dataclass(frozen=True)
class ReasoningPlan:
    start: str
    end: str
    start_id: int | None          # the opening tag's id, where it is one token
    end_id: int | None
    end_ids: tuple[int, ...]      # the closing tag as the tokens a spent budget forces
    starts_thinking: bool         # the prompt opened the thinking (the template wrote the opening tag)
    budget: int | None = None     # thinking tokens before the closing tag is forced; None: no limit
    # The harmony format (None: tags). `opened`: the message the prompt left open, from its last <|start|>
    # ("assistant", the generation prompt's); `calls`: messages to a function go to the answer as harmony text, for
    # the harmony call parser (else their arguments are answer text); `grammar_first`: the grammar holds the whole
    # output, headers and all (a call forced by tool_choice), not only the answer.
    harmony: HarmonyIds | None = None
    opened: str = ""
    calls: bool = False
    grammar_first: bool = False

    @property
    def first_phase(self) -> Phase:
        return Phase.THINKING if self.starts_thinking else Phase.BEFORE


def single(ids: tuple[int, ...]) -> int | None:
    """A tag's id where it is one token (found by id), else None (found in the text)."""
    return ids[0] if len(ids) == 1 else None


def make_plan(fmt: ReasoningFormat, prompt_ids: Sequence[int], encode: Callable[[str], Sequence[int]],
              decode: Callable[[Sequence[int]], str], budget: int | None, *, calls: bool = False,
              grammar_first: bool = False) -> ReasoningPlan:
    """A generation's plan: the format's tags (by id where single tokens), whether the prompt opened the thinking,
    and the budget; for harmony also its control tokens, the message the prompt opened, and `calls` and
    `grammar_first` (see `ReasoningPlan`)."""
    start, end = tuple(encode(fmt.start)), tuple(encode(fmt.end))
    tail = decode(prompt_ids[-PROMPT_TAIL_TOKENS:])
    if fmt.kind == "harmony":
        ids = HarmonyIds(*(single(tuple(encode(t))) for t in HARMONY_TOKENS))
        # Everything before the final channel's text is "thinking" to the gate; a spent budget closes the message
        # and opens the final one.
        forced = tuple(encode(HARMONY_TOKENS[1] + fmt.end))
        opened = tail[tail.rfind("<|start|>") + len("<|start|>"):] if "<|start|>" in tail else ""
        if any(t in opened for t in ("<|end|>", "<|call|>", "<|return|>")):
            opened = ""  # the prompt's last message is closed
        return ReasoningPlan(fmt.start, fmt.end, None, None, forced, True, budget, harmony=ids, opened=opened,
                             calls=calls, grammar_first=grammar_first)
    return ReasoningPlan(fmt.start, fmt.end, single(start), single(end), end, opens_thinking(tail, fmt), budget)
