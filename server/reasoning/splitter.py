"""`ReasoningSplitter`: one choice's output split, token by token, into its thinking and its answer.

The tags are found by id where they are single tokens, else in the text, across token and chunk boundaries:
text that could be the start of a tag is held until the next token says whether it is one, so a tag never leaks
into either side and no text is held past the end of the output. Whitespace right inside the tags (the newline
models write after `<think>` and before `</think>`) and before the answer is dropped, the same way whether the
output is streamed or not. Only an output that begins with the opening tag (after whitespace), or a prompt that
opened it, has thinking; the answer never goes back to thinking.
"""
from __future__ import annotations

from dataclasses import dataclass

from server.reasoning.plan import Phase, ReasoningPlan


@dataclass
class Split:
    reasoning: str = ""
    answer: str = ""

    def __iadd__(self, other: Split) -> Split:
        self.reasoning += other.reasoning
        self.answer += other.answer
        return self


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplitter:
    """Feed it each token and its text (`push`), then `finish`; `phase` says where the output is."""

    def __init__(self, plan: ReasoningPlan) -> None:
        self.plan = plan
        self.phase = plan.first_phase
        self.held = ""                 # text not given to either side yet
        self.answer_started = False    # the answer's leading whitespace is dropped
        self.thinking_started = False  # the thinking's leading whitespace is dropped
        self.reasoning_tokens = 0

    def push(self, token: int, text: str) -> Split:
        """The thinking and answer text this token adds."""
        plan, out = self.plan, Split()
        opening = token == plan.start_id and self.phase is Phase.BEFORE and not self.held.strip()
        if opening or self.phase is Phase.THINKING:
            self.reasoning_tokens += 1
        if opening:
            self.phase, self.held = Phase.THINKING, ""
            return out
        if token == plan.end_id and self.phase is Phase.THINKING:
            self.held = ""  # what was held is whitespace or part of a tag written as text: neither side's
            self.phase = Phase.ANSWER
            return out
        self.held += text
        return self._scan()

    def finish(self) -> Split:
        """The end of the output: what was held goes to the side it was on (a half-written tag is text)."""
        out, held, self.held = Split(), self.held, ""
        if self.phase is Phase.THINKING:
            out.reasoning = held.rstrip() if self.thinking_started else held.strip()
        else:
            out.answer = held if self.answer_started else held.lstrip()
        return out

    def _scan(self) -> Split:
        out = Split()
        while True:
            if self.phase is Phase.BEFORE:
                stripped = self.held.lstrip()
                if stripped.startswith(self.plan.start):
                    self.held, self.phase = stripped[len(self.plan.start):], Phase.THINKING
                    continue
                if not stripped or self.plan.start.startswith(stripped):
                    return out  # whitespace, or the opening tag so far: wait
                self.phase = Phase.ANSWER
            if self.phase is Phase.THINKING:
                at = self.held.find(self.plan.end)
                if at >= 0:
                    out.reasoning += self._thought(self.held[:at], final=True)
                    self.held, self.phase = self.held[at + len(self.plan.end):], Phase.ANSWER
                    continue
                keep = _partial_suffix(self.held, self.plan.end)
                body = self.held[:len(self.held) - keep]
                trailing = len(body) - len(body.rstrip())  # may be the whitespace before the closing tag
                out.reasoning += self._thought(body[:len(body) - trailing], final=False)
                self.held = self.held[len(body) - trailing:]
                return out
            # the answer
            text, self.held = self.held, ""
            if not self.answer_started:
                text = text.lstrip()
                self.answer_started = bool(text)
            out.answer += text
            return out

    def _thought(self, text: str, final: bool) -> str:
        if not self.thinking_started:
            text = text.lstrip()
            self.thinking_started = bool(text)
        return text.rstrip() if final else text
