"""A choice's output as the blocks the Responses and Messages APIs answer with: a reasoning model's thinking, then runs
of text and tool calls, in the order the model wrote them, as they stream.

`OutputBlocks.push(text, reasoning)` takes the next generated thinking and answer text and says what it changed: a block
opened, text (or a call's argument fragment) added to it, a block closed. Thinking makes a reasoning block (the first:
the thinking ends before the answer begins), which stays open until the answer's first block opens. With a tool plan the
text goes through the chat path's `ToolCallParser`, one character at a time so that text and calls keep their order, and
a call's fragments are exactly the ones chat streams as `delta.tool_calls`: they concatenate to its arguments.
Whitespace before a text block is held until text follows (whitespace around calls makes no block), and an output with
no answer block (none at all, or only thinking) gets one text block, so that a plain answer always has its text block
(chat's rule: content is null only beside calls).
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from server.api.openai.tool_calls import ToolPlan
from server.api.tool_parser import ToolCallFragment, new_call_id

__all__ = ["BlockEvent", "OutputBlock", "OutputBlocks", "call_input"]


@dataclass
class OutputBlock:
    kind: Literal["reasoning", "text", "call"]
    text: str = ""     # the text (the thinking's, for reasoning), or a call's arguments (JSON) as the model wrote them
    call_id: str = ""  # calls only
    name: str = ""     # calls only


@dataclass(frozen=True)
class BlockEvent:
    kind: Literal["open", "delta", "close"]
    index: int          # the block's place in the output
    block: OutputBlock
    delta: str = ""     # "delta": the text added


def call_input(block: OutputBlock) -> dict[str, Any]:
    """A call's arguments as an object; {} for arguments that a length cut left unfinished (not JSON)."""
    try:
        value = json.loads(block.text)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


class OutputBlocks:
    """One choice's blocks so far (`blocks`), fed its text as it comes."""

    def __init__(self, tools: ToolPlan | None, new_id: Callable[[], str] = new_call_id) -> None:
        """`tools`: the plan whose calls the output may make (None: the output is text); `new_id` makes call ids."""
        self._parser = tools.parser(new_id) if tools is not None else None
        self.blocks: list[OutputBlock] = []
        self._open: OutputBlock | None = None
        self._held = ""                     # whitespace that no text block holds yet
        self._of_call: dict[int, int] = {}  # the parser's call index -> its block's index

    @property
    def text(self) -> str:
        """The text of every text block."""
        return "".join(b.text for b in self.blocks if b.kind == "text")

    @property
    def reasoning(self) -> str:
        """The thinking."""
        return "".join(b.text for b in self.blocks if b.kind == "reasoning")

    @property
    def calls(self) -> list[OutputBlock]:
        return [b for b in self.blocks if b.kind == "call"]

    def push(self, text: str, reasoning: str = "") -> list[BlockEvent]:
        """The changes that the next piece of the output makes: `reasoning`, thinking, then `text`, answer."""
        events: list[BlockEvent] = []
        if reasoning:
            if self._open is None or self._open.kind != "reasoning":
                self._start(OutputBlock("reasoning"), events)
            self._add(reasoning, events)
        if self._parser is None:
            self._text(text, events)
        else:
            for ch in text:
                content, deltas = self._parser.push(ch)
                self._text(content, events)
                self._calls(deltas, events)
        return _merged(events)

    def finish(self) -> list[BlockEvent]:
        """The end of the output: what the parser held back, and the last block closed."""
        events: list[BlockEvent] = []
        if self._parser is not None:
            content, deltas = self._parser.finish()
            self._text(content, events)
            self._calls(deltas, events)
        if all(b.kind == "reasoning" for b in self.blocks):
            self._start(OutputBlock("text"), events)
            self._add(self._held, events)
        self._held = ""
        self._close(events)
        return _merged(events)

    def _text(self, content: str, events: list[BlockEvent]) -> None:
        if not content:
            return
        if self._open is not None and self._open.kind == "text":
            self._add(content, events)
        elif not content.strip():
            self._held += content
        else:
            self._start(OutputBlock("text"), events)
            self._add(self._held + content, events)
            self._held = ""

    def _calls(self, deltas: list[ToolCallFragment], events: list[BlockEvent]) -> None:
        for d in deltas:
            if d.id is not None:  # a call's first delta
                self._start(OutputBlock("call", call_id=d.id, name=d.name or ""), events)
                self._of_call[d.index] = len(self.blocks) - 1
                self._held = ""  # whitespace before a call belongs to no block
            if d.arguments:
                index = self._of_call[d.index]
                block = self.blocks[index]
                block.text += d.arguments
                events.append(BlockEvent("delta", index, block, d.arguments))

    def _add(self, text: str, events: list[BlockEvent]) -> None:
        block = self._open
        if text and block is not None:
            block.text += text
            events.append(BlockEvent("delta", len(self.blocks) - 1, block, text))

    def _start(self, block: OutputBlock, events: list[BlockEvent]) -> None:
        self._close(events)
        self.blocks.append(block)
        self._open = block
        events.append(BlockEvent("open", len(self.blocks) - 1, block))

    def _close(self, events: list[BlockEvent]) -> None:
        if self._open is not None:
            events.append(BlockEvent("close", len(self.blocks) - 1, self._open))
            self._open = None


def _merged(events: list[BlockEvent]) -> list[BlockEvent]:
    """Consecutive deltas of one block as one (the parser is fed a character at a time)."""
    out: list[BlockEvent] = []
    for e in events:
        last = out[-1] if out else None
        if last is not None and e.kind == last.kind == "delta" and e.index == last.index:
            out[-1] = BlockEvent("delta", e.index, e.block, last.delta + e.delta)
        else:
            out.append(e)
    return out
