"""Generated text → content and OpenAI tool-call deltas, as it streams.

`ToolCallParser.push(text)` returns the content that is now safe to send and the tool-call deltas the text
completed: a call's first delta carries its index, a new id and the function name; later ones carry fragments of
its arguments, the exact characters the model wrote, so the fragments of a call concatenate to its final
`arguments` (the non-streaming form, `calls`, is the same text). Call formats (see `server.api.openai.tool_calls`):

- "hermes": text, then `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Qwen2/2.5/3);
- "llama3": the whole output one `{"name": ..., "parameters": {...}}` object when it starts with "{" (Llama 3.x);
- "generic": the whole output one JSON envelope, `{"tool_call": CALL}`, `{"tool_calls": [CALL, ...]}` or
  `{"response": "text"}` (the text streams as content), as llama-server's generic format;
- "harmony" (gpt-oss) is parsed by `server.api.harmony_calls.HarmonyCallParser`, which has this interface.

The JSON is followed one character at a time by `_JsonCursor` (the grammar has already made it valid), so a
call's name and arguments are known the moment their characters arrive, however the text is cut into tokens.
"""
from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["ParsedCall", "ToolCallFragment", "ToolCallParser", "ToolFormatName", "new_call_id"]

ToolFormatName = Literal["hermes", "llama3", "generic", "harmony"]
Path = tuple[str | int, ...]
_WS = " \t\n\r"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCallFragment:
    index: int
    arguments: str
    id: str | None = None    # first delta of a call only
    name: str | None = None  # first delta of a call only


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str = ""


@dataclass
class _Frame:
    kind: str          # "{" or "["
    path: Path         # the container's own path
    expect: str        # what comes next: "key", "colon", "value", "comma"
    key: str | int | None = None
    count: int = 0     # array items so far


class _JsonCursor:
    """Follows one JSON value a character at a time. `feed` returns events: ("start", path) as a value begins,
    ("end", path, inclusive) as it ends (with this character, or just before it for numbers and literals), and
    ("text", path, decoded) for the characters of a string value."""

    def __init__(self) -> None:
        self.stack: list[_Frame] = []
        self.done = False
        self.started = False
        self._string: str | None = None  # "key" or "value" while inside a string
        self._key = ""
        self._escape = ""                # an escape sequence being read ("\\", "\\u00")
        self._high = ""                  # a high surrogate waiting for its pair
        self._literal: Path | None = None

    def _path(self) -> Path:
        frame = self.stack[-1]
        return (*frame.path, frame.key)

    def _ended(self) -> None:
        if self.stack:
            self.stack[-1].expect = "comma"
        else:
            self.done = True

    def feed(self, ch: str) -> list[tuple]:
        events: list[tuple] = []
        if self._literal is not None:
            if ch not in ",}]" and ch not in _WS:
                return events
            events.append(("end", self._literal, False))
            self._literal = None
            self._ended()
        if self._string is not None:
            self._string_char(ch, events)
            return events
        if self.done or ch in _WS:
            return events
        frame = self.stack[-1] if self.stack else None
        expect = frame.expect if frame else "value"
        if frame is not None and ch in "}]" and expect in ("key", "value", "comma"):
            self.stack.pop()
            events.append(("end", frame.path, True))
            self._ended()
        elif expect == "value":
            if frame is not None and frame.kind == "[":
                frame.key, frame.count = frame.count, frame.count + 1
            path = self._path() if frame else ()
            self.started = True
            events.append(("start", path))
            if ch in "{[":
                self.stack.append(_Frame(ch, path, "key" if ch == "{" else "value"))
            elif ch == '"':
                self._string = "value"
            else:
                self._literal = path
        elif expect == "key" and ch == '"':
            self._string, self._key = "key", ""
        elif expect == "colon" and ch == ":":
            frame.expect = "value"
        elif expect == "comma" and ch == ",":
            frame.expect = "key" if frame.kind == "{" else "value"
        return events

    def _string_char(self, ch: str, events: list[tuple]) -> None:
        if self._escape:
            self._escape += ch
            if self._escape[1] == "u" and len(self._escape) < 6:
                return
            raw, self._escape = self._high + self._escape, ""
            decoded = json.loads(f'"{raw}"')  # a valid escape: the grammar wrote it
            if "\ud800" <= decoded[-1] <= "\udbff" and len(decoded) == 1:
                self._high = raw  # wait for the low surrogate of the pair
                return
            self._high = ""
            # A surrogate without its pair is no character: U+FFFD, as a decoder shows broken UTF-8.
            self._string_text("".join("\ufffd" if "\ud800" <= c <= "\udfff" else c for c in decoded), events)
        elif ch == "\\":
            self._escape = ch
        elif ch == '"':
            if self._high:  # a high surrogate that no low one followed
                self._high = ""
                self._string_text("\ufffd", events)
            if self._string == "key":
                self.stack[-1].key, self.stack[-1].expect = self._key, "colon"
            else:
                events.append(("end", self._path() if self.stack else (), True))
                self._ended()
            self._string = None
        else:
            self._string_text(ch, events)

    def _string_text(self, text: str, events: list[tuple]) -> None:
        if self._string == "key":
            self._key += text
        else:
            events.append(("text", self._path() if self.stack else (), text))


@dataclass
class _CallState:
    call: ParsedCall
    named: bool = False   # its name is complete
    sent: bool = False    # its first delta (id, name) went out
    pending: list[str] = field(default_factory=list)  # argument characters not sent yet


class ToolCallParser:
    """One choice's output in one of the call formats; `content` and `calls` hold everything parsed so far."""

    def __init__(self, fmt: ToolFormatName, *, start_marker: str = "<tool_call>", end_marker: str = "</tool_call>",
                 new_id: Callable[[], str] = new_call_id, json_response: bool = False) -> None:
        """`json_response`: a generic "response" is JSON (of a response_format), sent as its text; else a string,
        sent decoded."""
        self.format, self.start_marker, self.end_marker, self._new_id = fmt, start_marker, end_marker, new_id
        self.json_response = json_response
        self.args_key = "parameters" if fmt == "llama3" else "arguments"
        self.content = ""
        self.calls: list[ParsedCall] = []
        self._states: dict[int, _CallState] = {}
        self._cursor = _JsonCursor()
        self._block = 0                         # hermes / llama3: the call index of the current JSON object
        self._capturing: _CallState | None = None
        self._answering = False                 # inside a generic JSON "response"
        # "text" (hermes, outside calls), "after" (hermes, after a call), "json", "closing" (hermes, after a
        # call's JSON until its end marker), "undecided" (llama3/generic before the first character), "plain", "done"
        self._mode = "text" if fmt == "hermes" else "undecided"
        self._held = ""  # text that may begin the start marker, whitespace after a call, leading whitespace

    def push(self, text: str) -> tuple[str, list[ToolCallFragment]]:
        """The content and the call deltas that `text`, the next piece of the output, completes."""
        content: list[str] = []
        for ch in text:
            self._char(ch, content)
        out = "".join(content)
        self.content += out
        return out, self._deltas(final=False)

    def finish(self) -> tuple[str, list[ToolCallFragment]]:
        """The end of the output: text held back as a possible marker start is content after all."""
        out = ""
        if self._mode in ("text", "undecided") or (self._mode == "after" and self._held.strip()):
            out = self._held
        self._held = ""
        self.content += out
        return out, self._deltas(final=True)

    # ---- characters ----
    def _char(self, ch: str, content: list[str]) -> None:
        mode = self._mode
        if mode == "undecided":  # llama3 / generic: JSON when the output starts with "{"
            if ch in _WS:
                self._held += ch
            elif ch == "{":
                self._mode, self._held = "json", ""
                self._json_char(ch, content)
            else:
                self._mode = "plain"
                content.append(self._held + ch)
                self._held = ""
        elif mode == "plain":
            content.append(ch)
        elif mode == "json":
            self._json_char(ch, content)
        elif mode in ("text", "after"):
            self._text_char(ch, content)
        elif mode == "closing":
            self._held += ch
            if self._held.endswith(self.end_marker):
                self._mode, self._held = "after", ""
        elif ch not in _WS:  # "done": text after the JSON (no grammar allows it, but do not lose it)
            content.append(ch)

    def _text_char(self, ch: str, content: list[str]) -> None:
        """Hermes text around calls; what may be the start of the start marker is held back."""
        held, marker = self._held + ch, self.start_marker
        if held.endswith(marker):
            before = held[:-len(marker)]
            if self._mode == "text" or before.strip():
                content.append(before)
            self._mode, self._held = "json", ""
            self._cursor, self._block = _JsonCursor(), len(self._states)
            return
        keep = next((k for k in range(min(len(marker) - 1, len(held)), 0, -1) if marker.startswith(held[-k:])), 0)
        text, self._held = held[:len(held) - keep], held[len(held) - keep:]
        if self._mode == "after":
            if not text.strip():  # whitespace between and after calls is no content
                self._held = text + self._held
                return
            self._mode = "text"
        content.append(text)

    def _json_char(self, ch: str, content: list[str]) -> None:
        take = self._capturing
        answer = self._answering
        for event in self._cursor.feed(ch):
            kind, path = event[0], event[1]
            located = self._call_of(path)
            if located is None:
                if self.format == "generic" and path == ("response",):
                    if not self.json_response and kind == "text":
                        content.append(event[2])
                    elif self.json_response and kind == "start":
                        self._answering = answer = True
                    elif self.json_response and kind == "end":
                        self._answering = False
                        answer = event[2]
                continue
            index, rel = located
            state = self._states.get(index)
            if state is None:
                state = self._states[index] = _CallState(ParsedCall(self._new_id(), ""))
                self.calls.append(state.call)
            if rel == ("name",):
                if kind == "text":
                    state.call.name += event[2]
                elif kind == "end":
                    state.named = True
            elif rel == (self.args_key,):
                if kind == "start":
                    self._capturing = take = state
                elif kind == "end":
                    self._capturing = None
                    take = state if event[2] else None  # a closing "}" belongs to the arguments, a "," not
        if take is not None:
            take.pending.append(ch)
        if answer:  # a JSON answer's characters, as written
            content.append(ch)
        if self._cursor.done:
            self._mode, self._held = ("closing" if self.format == "hermes" else "done"), ""

    def _call_of(self, path: Path) -> tuple[int, Path] | None:
        """(call index, path inside the call object) of a path in the JSON value; None outside every call."""
        if self.format != "generic":
            return (self._block, path) if path else None
        if path[:1] == ("tool_call",):
            return 0, path[1:]
        if path[:1] == ("tool_calls",) and len(path) >= 2 and isinstance(path[1], int):
            return path[1], path[2:]
        return None

    def _deltas(self, final: bool) -> list[ToolCallFragment]:
        """A call's first delta once its name is complete (or the output ended), then its new argument text."""
        deltas = []
        for index in sorted(self._states):
            state = self._states[index]
            if not (state.named or final):
                continue
            fragment = "".join(state.pending)
            state.pending.clear()
            state.call.arguments += fragment
            if not state.sent:
                state.sent = True
                deltas.append(ToolCallFragment(index, fragment, id=state.call.id, name=state.call.name))
            elif fragment:
                deltas.append(ToolCallFragment(index, fragment))
        return deltas
