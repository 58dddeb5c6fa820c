"""`HarmonySplitter`: one choice's harmony output (gpt-oss) split, token by token, into its thinking and its answer.

Harmony output is a run of messages, `<|start|>{header}<|message|>{text}<|end|>`, the first one's `<|start|>` and
role written by the prompt (`<|start|>assistant`), the last one ended by `<|return|>` (an answer) or `<|call|>` (a
tool call) instead of `<|end|>`. The header names the role, the channel (`<|channel|>analysis`, `commentary`,
`final`), a recipient (`to=functions.get_weather`, before or after the channel) and a content type
(`<|constrain|>json`, or a bare `json`). The control tokens are special tokens, found by id (their text is not in
the decoded output), and the splitter routes each message's text by its header:

- the analysis channel (and messages to built-in tools such as `python` or `browser.*`) is the thinking;
- the final channel, and commentary with no recipient (a preamble meant for the user), is the answer;
- a message to `functions.NAME` is a tool call: with `plan.calls` it goes to the answer as harmony text,
  `<|start|>{header}<|message|>{arguments}<|call|>`, for the harmony call parser (server/api/harmony_calls.py);
  without, its arguments are answer text.

Headers and control tokens go to neither side. `phase` is THINKING until the first final message's text starts,
then ANSWER for good: what the reasoning gate (server/reasoning/gate.py) holds the grammar of an answer back for.
"""
from __future__ import annotations

import re
from typing import Literal

from server.reasoning.plan import Phase, ReasoningPlan
from server.reasoning.splitter import ReasoningSplitter, Split

FUNCTIONS = "functions."
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")
Route = Literal["reasoning", "answer", "call"]


def header_route(header: str) -> tuple[Route, str | None, str]:
    """Where a message's text goes, by its header (the text between `<|start|>` and `<|message|>`, control tokens
    spelt), its recipient and its channel."""
    found = _RECIPIENT.search(header)
    recipient = found.group(1) if found else None
    found = _CHANNEL.search(header)
    channel = found.group(1) if found else ""
    if recipient is not None and recipient.startswith(FUNCTIONS):
        return "call", recipient, channel
    if recipient is not None or channel == "analysis":
        return "reasoning", recipient, channel
    return "answer", recipient, channel  # final, a commentary preamble, or a message without a channel


class HarmonySplitter:
    """Feed it each token and its text (`push`), then `finish`; `phase` says whether the answer has begun."""

    def __init__(self, plan: ReasoningPlan) -> None:
        assert plan.harmony is not None
        self.plan, self.ids = plan, plan.harmony
        self.phase = Phase.THINKING
        self.reasoning_tokens = 0           # the thinking messages' tokens, headers and ends included
        self.header: str | None = None      # the open message's header while it is read (None: no message open)
        self.header_tokens = 0
        self.route: Route | None = None     # the open message's route once its text started
        if plan.opened:
            head, sep, _ = plan.opened.partition("<|message|>")
            self.header = head
            if sep:  # the prompt opened the message's text too
                self._open()

    def push(self, token: int, text: str) -> Split:
        """The thinking and answer text this token adds."""
        out, ids, route = Split(), self.ids, self.route
        if token == ids.start and route is not None:  # a new message: the open one ends (<|end|> left out)
            out += self.push(ids.end, "")
            route = None
        if token in (ids.end, ids.call, ids.return_):
            if route == "reasoning":
                self.reasoning_tokens += 1
            elif route == "call" and self.plan.calls:  # whatever ended it (<|call|>, as gpt-oss does, or not)
                out.answer = "<|call|>"
            self.header, self.route = None, None
        elif route == "reasoning":
            self.reasoning_tokens += 1
            out.reasoning = text
        elif route is not None:
            out.answer = text
        elif token == ids.start:
            self.header, self.header_tokens = "", 1
        elif token == ids.message:
            if self.header is not None:
                self.header_tokens += 1
                out = self._open()
        elif token in (ids.channel, ids.constrain) or self.header is not None:
            if self.header is None:  # a channel with no <|start|> before it: a new message all the same
                self.header, self.header_tokens = "", 0
            self.header += self.ids.text(token) or text
            self.header_tokens += 1
        # else: text outside any message, which no harmony output has, is nobody's
        return out

    def _open(self) -> Split:
        """The header is complete: the message's text starts."""
        header = self.header or ""
        self.route, recipient, channel = header_route(header)
        out = Split()
        if self.route == "reasoning":
            self.reasoning_tokens += self.header_tokens
        elif self.route == "call" and self.plan.calls:
            out.answer = f"<|start|>{header}<|message|>"
        elif channel == "final":
            self.phase = Phase.ANSWER
        return out

    def finish(self) -> Split:
        """The end of the output: nothing is held back (an unfinished header is nobody's)."""
        return Split()


def new_splitter(plan: ReasoningPlan) -> ReasoningSplitter | HarmonySplitter:
    """The splitter of a plan: harmony's messages, or a tag pair."""
    return HarmonySplitter(plan) if plan.harmony is not None else ReasoningSplitter(plan)
