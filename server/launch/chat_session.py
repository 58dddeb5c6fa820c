"""The terminal chat's conversation: its messages, system prompt and sampling values, the `/` commands that change
them, and what answers it (`ChatBackend`: a server over HTTP, or a model in this process)."""
from __future__ import annotations

import json
import shlex
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from server.launch.flags import SAMPLING_OPTIONS, option_value

HELP = '''Type a message and press Enter; the answer streams as it comes.
  """        a line starting with """ opens a multi-line message; a line ending with """ sends it
  /reset     forget the conversation (the system prompt stays)
  /system TEXT   set the system prompt (/system alone shows it; /system none removes it)
  /set NAME VALUE   set a sampling value for the next answers: {names}
             (/set NAME default: back to the preset's or model's; /set alone lists the values set)
  /save FILE  write the conversation (system prompt, messages, values) to FILE as JSON
  /help      this text
  /quit      leave (also /exit, or Ctrl-D)
  Ctrl-C     during an answer: stop it (its generation ends; what came of it stays in the conversation);
             at the prompt: clear the line'''.format(names=", ".join(SAMPLING_OPTIONS))


class ChatError(Exception):
    """An answer that failed: one line saying why (the conversation goes on)."""


class EndChat(Exception):
    """/quit: leave the chat."""


class ChatBackend(Protocol):
    """What answers the conversation."""

    model: str

    def stream(self, messages: list[dict[str, str]], options: dict[str, Any]) -> Generator[str, None, None]:
        """The answer to `messages` in pieces as they come (ChatError when it fails); closing the iterator early
        stops the generation."""
        ...

    def close(self) -> None: ...


@dataclass
class Conversation:
    """The system prompt, the turns so far and the sampling values every answer is asked with."""

    system: str | None = None
    turns: list[dict[str, str]] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)

    def messages(self) -> list[dict[str, str]]:
        """What the next answer is asked for: the system prompt, then every turn."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + self.turns

    def to_json(self, model: str) -> dict[str, Any]:
        return {"model": model, "options": self.options, "messages": self.messages()}


def run_command(conversation: Conversation, line: str, model: str) -> str:
    """Carry out a `/` command line; what to print. EndChat for /quit; ValueError: a one-line error."""
    name, _, rest = line.strip().partition(" ")
    rest = rest.strip()
    if name in ("/quit", "/exit", "/bye"):
        raise EndChat
    if name == "/help":
        return HELP
    if name in ("/reset", "/clear"):
        conversation.turns.clear()
        return "(the conversation is cleared" + ("; the system prompt stays)" if conversation.system else ")")
    if name == "/system":
        if not rest:
            return f"system prompt: {conversation.system}" if conversation.system else "(no system prompt)"
        conversation.system = None if rest.lower() == "none" else rest
        return "(system prompt set)" if conversation.system else "(system prompt removed)"
    if name == "/set":
        return _set(conversation, rest)
    if name == "/save":
        if not rest:
            raise ValueError("/save FILE: name the file to write")
        path = Path(shlex.split(rest)[0]).expanduser()
        try:
            path.write_text(json.dumps(conversation.to_json(model), indent=2, ensure_ascii=False) + "\n")
        except OSError as e:
            raise ValueError(f"cannot write {path}: {e.strerror or e}") from None
        return f"(saved {len(conversation.turns)} messages to {path})"
    raise ValueError(f"unknown command {name} (/help lists them)")


def _set(conversation: Conversation, rest: str) -> str:
    if not rest:
        values = ", ".join(f"{k} {v}" for k, v in conversation.options.items())
        return f"values set: {values}" if values else "(no values set: the preset's and model's apply)"
    name, _, text = rest.partition(" ")
    name, text = name.replace("-", "_").lower(), text.strip()
    if name not in SAMPLING_OPTIONS:
        raise ValueError(f"unknown value {name!r}; /set takes {', '.join(SAMPLING_OPTIONS)}")
    if not text:
        raise ValueError(f"/set {name} VALUE: give a value (or default)")
    if text.lower() == "default":
        conversation.options.pop(name, None)
        return f"({name}: the default)"
    try:
        conversation.options[name] = option_value(name, text)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
    return f"({name} {conversation.options[name]})"
