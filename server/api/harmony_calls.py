"""Harmony tool calls (gpt-oss) → content and OpenAI tool-call deltas, as the answer streams.

A harmony model calls a function with a message to it: `<|start|>assistant<|channel|>commentary
to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>`, the recipient in the channel's part
of the header or before it (`<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>...`).
The control tokens are special tokens, so the reasoning splitter (server/reasoning/harmony.py) writes such a message
into the answer as this text and everything else of the answer as plain text; `HarmonyCallParser` reads it back:
the calls, in order, and the text around them as content. Its interface is `ToolCallParser`'s
(server/api/tool_parser.py): a call's first delta carries its index, a new id and the name (once the header is
complete), later ones fragments of its arguments, exactly as the model wrote them.
"""
from __future__ import annotations

import re
from collections.abc import Callable

from server.api.tool_parser import ParsedCall, ToolCallFragment, new_call_id

__all__ = ["HarmonyCallParser"]

CALL_START, HEADER_END = "<|start|>", "<|message|>"
CALL_ENDS = ("<|call|>", "<|end|>")  # <|end|>: a call message closed as an ordinary one
_RECIPIENT = re.compile(r"\bto=functions\.([^\s<]+)")


def _partial(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is a proper beginning of one of `markers`."""
    for n in range(min(max(map(len, markers)) - 1, len(text)), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return n
    return 0


class HarmonyCallParser:
    """One choice's answer with harmony calls in it; `content` and `calls` hold everything parsed so far."""

    def __init__(self, *, new_id: Callable[[], str] = new_call_id) -> None:
        self._new_id = new_id
        self.content = ""
        self.calls: list[ParsedCall] = []
        self._mode = "text"   # "text", "header" (after <|start|>), "arguments" (after <|message|>)
        self._held = ""       # text that may begin a marker, or the header so far

    def push(self, text: str) -> tuple[str, list[ToolCallFragment]]:
        """The content and the call deltas that `text`, the next piece of the answer, completes."""
        content: list[str] = []
        deltas: list[ToolCallFragment] = []
        held = self._held + text
        self._held = ""
        while held:
            if self._mode == "text":
                at = held.find(CALL_START)
                if at < 0:
                    keep = _partial(held, (CALL_START,))
                    content.append(held[:len(held) - keep])
                    self._held = held[len(held) - keep:]
                    break
                content.append(held[:at])
                held, self._mode = held[at + len(CALL_START):], "header"
            elif self._mode == "header":
                at = held.find(HEADER_END)
                if at < 0:
                    self._held = held
                    break
                found = _RECIPIENT.search(held[:at])
                call = ParsedCall(self._new_id(), found.group(1) if found else "")
                self.calls.append(call)
                deltas.append(ToolCallFragment(len(self.calls) - 1, "", id=call.id, name=call.name))
                held, self._mode = held[at + len(HEADER_END):], "arguments"
            else:
                ends = [(held.find(m), m) for m in CALL_ENDS if m in held]
                if ends:
                    at, marker = min(ends)
                    self._arguments(held[:at], deltas)
                    held, self._mode = held[at + len(marker):], "text"
                    continue
                keep = _partial(held, CALL_ENDS)
                self._arguments(held[:len(held) - keep], deltas)
                self._held = held[len(held) - keep:]
                break
        out = "".join(content)
        self.content += out
        return out, _merged(deltas)

    def finish(self) -> tuple[str, list[ToolCallFragment]]:
        """The end of the answer: held text is content (or a call's last arguments; an unfinished header is
        dropped)."""
        held, self._held = self._held, ""
        deltas: list[ToolCallFragment] = []
        out = ""
        if self._mode == "text":
            out = held
        elif self._mode == "arguments":
            self._arguments(held, deltas)
        self.content += out
        return out, deltas

    def _arguments(self, text: str, deltas: list[ToolCallFragment]) -> None:
        if text:
            self.calls[-1].arguments += text
            deltas.append(ToolCallFragment(len(self.calls) - 1, text))


def _merged(deltas: list[ToolCallFragment]) -> list[ToolCallFragment]:
    """A call's consecutive fragments of one push as one delta (its first, with id and name, takes the text)."""
    out: list[ToolCallFragment] = []
    for d in deltas:
        if out and out[-1].index == d.index and d.id is None:
            out[-1].arguments += d.arguments
        else:
            out.append(ToolCallFragment(d.index, d.arguments, d.id, d.name))
    return out
