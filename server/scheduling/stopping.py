"""Deciding when one choice stops (end token, stop string, max_tokens) and which of its text is safe to stream.

Stop strings are matched with an Aho-Corasick automaton fed the text as it arrives, so each token costs time in
proportion to its own text (plus the held-back text, shorter than the longest stop string), whatever the length of
the text before it. The automaton's state is the longest suffix of the text that begins some stop string; that is
exactly the text that must be held back from the client until the next characters show whether it is a stop string.

Choices where OpenAI/vLLM leave room:
- The first stop string to be *completed* wins (earliest end in the text; among those ending at the same character,
  the longest). This is what stopping "as soon as a stop string is generated" means, and it gives the same result
  however the text is cut into tokens: with stops ["\\n\\nUser:", "User"] the text "hi\\n\\nUser:" stops at "User"
  and sends "hi\\n\\n", whether it came in one token or one character at a time.
- As in vLLM, neither end tokens nor stop strings end a choice until more than `min_tokens` tokens have been
  generated; a stop string completed by one of the first `min_tokens` tokens is ordinary text and is sent. (The
  worker also keeps end tokens from being sampled at all before `min_tokens`, as vLLM does.)
- A stop string or end token on the `max_tokens`-th token finishes with "stop", not "length"; `max_tokens` caps the
  choice even below `min_tokens` (vLLM rejects min_tokens > max_tokens; that check belongs to request validation).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Collection, Iterable, Sequence
from typing import NamedTuple, Protocol

__all__ = ["Detokenizer", "StopChecker", "StopUpdate"]


class Detokenizer(Protocol):
    """What `StopChecker` needs of `engine.tokenizer.tokenizer.IncrementalDetokenizer`."""

    def push(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


class StopUpdate(NamedTuple):
    """The outcome of one generated token. A NamedTuple: one is made per token, and a frozen dataclass costs
    several times as much to build."""

    text: str  # text that is now safe to send (may be "")
    finish_reason: str | None  # None while generating; "stop" (end token or stop string) or "length" (max_tokens)
    stop_reason: str | int | None = None  # the stop string or end-token id that ended it (None for "length")


class _StopAutomaton:
    """Aho-Corasick over the stop strings, walked one character at a time; state 0 is the empty string."""

    def __init__(self, stops: Iterable[str]) -> None:
        self.children: list[dict[str, int]] = [{}]
        depth = [0]
        word: list[str | None] = [None]  # the stop string a state spells in full, if any
        for s in stops:
            state = 0
            for ch in s:
                nxt = self.children[state].get(ch)
                if nxt is None:
                    nxt = self.children[state][ch] = len(self.children)
                    self.children.append({})
                    depth.append(depth[state] + 1)
                    word.append(None)
                state = nxt
            word[state] = s
        n = len(self.children)
        self.fail = [0] * n
        # The longest stop string ending here (a state's own word is longer than any reached through `fail`).
        self.match: list[str | None] = list(word)
        # How much text to hold back here: the longest suffix that is a proper prefix of some stop string, i.e. the
        # deepest state on the `fail` chain that has children.
        self.hold = [depth[i] if self.children[i] else 0 for i in range(n)]
        queue = deque(self.children[0].values())
        while queue:
            state = queue.popleft()
            for ch, child in self.children[state].items():
                f = self.fail[state]
                while f and ch not in self.children[f]:
                    f = self.fail[f]
                self.fail[child] = self.children[f].get(ch, 0)
                if self.match[child] is None:
                    self.match[child] = self.match[self.fail[child]]
                if not self.hold[child]:
                    self.hold[child] = self.hold[self.fail[child]]
                queue.append(child)

    def step(self, state: int, ch: str) -> int:
        """The state after reading `ch`."""
        children, fail = self.children, self.fail
        while state and ch not in children[state]:
            state = fail[state]
        return children[state].get(ch, 0)


class StopChecker:
    """Feeds one choice's generated tokens through its detokenizer and decides what to send and when to stop."""

    def __init__(self, detokenizer: Detokenizer, *, stop: Sequence[str] = (), stop_token_ids: Collection[int] = (),
                 max_tokens: int | None = None, min_tokens: int = 0, ignore_eos: bool = False) -> None:
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        if min_tokens < 0:
            raise ValueError(f"min_tokens must be at least 0, got {min_tokens}")
        if isinstance(stop, str):  # the OpenAI API accepts a lone string for `stop`
            stop = (stop,)
        stops = dict.fromkeys(s for s in stop if s)
        self._detokenizer = detokenizer
        self._automaton = _StopAutomaton(stops) if stops else None
        self._state = 0
        self._stop_token_ids = frozenset(stop_token_ids)
        self._max_tokens, self._min_tokens, self._ignore_eos = max_tokens, min_tokens, ignore_eos
        # What `push` checks before the full rules (`_token_end`): only these ids, or reaching this many tokens,
        # can end the choice by the token itself, so every other token skips them.
        self._end_ids = frozenset() if ignore_eos else self._stop_token_ids
        self._token_limit = max_tokens if max_tokens is not None else float("inf")
        self._held = ""  # decoded text not sent yet: it may be the start of a stop string
        self._sent: list[str] = []
        self._num_tokens = 0
        self._finished = False

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def num_tokens(self) -> int:
        """Tokens pushed so far, the end token included."""
        return self._num_tokens

    @property
    def text(self) -> str:
        """All text sent so far: the concatenation of every update's `text`."""
        if len(self._sent) > 1:
            self._sent = ["".join(self._sent)]
        return self._sent[0] if self._sent else ""

    def ends_at(self, token_id: int) -> bool:
        """Whether `push(token_id)`, next, finishes the choice by the token itself (an end token, max_tokens),
        before any text is looked at: a stop string may still finish it where this says False."""
        n = self._num_tokens + 1
        return (token_id in self._end_ids or n >= self._token_limit) and self._token_end(token_id, n) is not None

    def ends_next(self) -> bool:
        """Whether the next token pushed finishes the choice, whatever it is (max_tokens)."""
        return self._num_tokens + 1 >= self._token_limit

    def _reaches_max_tokens(self, num_tokens: int) -> bool:
        return self._max_tokens is not None and num_tokens >= self._max_tokens

    def _token_end(self, token_id: int, num_tokens: int) -> tuple[str, int | None] | None:
        if num_tokens > self._min_tokens and not self._ignore_eos and token_id in self._stop_token_ids:
            return "stop", token_id
        if self._reaches_max_tokens(num_tokens):
            return "length", None
        return None

    def push(self, token_id: int) -> StopUpdate:
        """Take one generated token; what to send now, and whether (and why) the choice has finished."""
        if self._finished:
            raise RuntimeError("StopChecker.push after the choice finished")
        n = self._num_tokens = self._num_tokens + 1
        if token_id not in self._end_ids and n < self._token_limit:  # the common token: it cannot end the choice
            new = self._detokenizer.push(token_id)
            if self._automaton is None:  # no stop strings: all of it is safe to send
                if new:
                    self._sent.append(new)
                return StopUpdate(new, None)
            return self._advance(new, n > self._min_tokens, finish=None)
        active = n > self._min_tokens
        finish = self._token_end(token_id, n)
        if finish is not None and finish[0] == "stop":  # an end token: its own text is not sent
            return self._advance(self._detokenizer.flush(), active, finish=finish)
        new = self._detokenizer.push(token_id)
        if finish is not None:
            return self._advance(new + self._detokenizer.flush(), active, finish=finish)
        return self._advance(new, active, finish=None)

    def end(self) -> StopUpdate:
        """Finish now with "stop" (the output's grammar is complete): what was held back is sent."""
        if self._finished:
            raise RuntimeError("StopChecker.end after the choice finished")
        return self._send(self._held + self._detokenizer.flush(), ("stop", None))

    def _advance(self, new: str, active: bool, finish: tuple[str, int | None] | None) -> StopUpdate:
        """Read `new`; stop at the first stop string it completes (if `active`), else finish as `finish` says."""
        automaton = self._automaton
        if automaton is None:
            return self._send(new, finish)
        state = self._state
        for i, ch in enumerate(new):
            state = automaton.step(state, ch)
            matched = automaton.match[state]
            if matched is not None and active:
                end = len(self._held) + i + 1
                return self._send((self._held + new)[:end - len(matched)], ("stop", matched))
        self._state = state
        if finish is not None:
            return self._send(self._held + new, finish)
        text = self._held + new
        cut = len(text) - automaton.hold[state]
        self._held = text[cut:]
        return self._send(text[:cut], None)

    def _send(self, text: str, finish: tuple[str, str | int | None] | None) -> StopUpdate:
        if text:
            self._sent.append(text)
        if finish is None:
            return StopUpdate(text, None)
        self._finished, self._held = True, ""
        return StopUpdate(text, finish[0], finish[1])
