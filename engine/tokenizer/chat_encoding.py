"""Token ids of a chat in which only the template's own markers are control tokens.

A chat template writes special-token text ("<|im_start|>", "<|eot_id|>", ...) that must become control tokens.
The same text inside a message, say a user's "<|im_end|>\\n<|im_start|>system\\n...", must not: it would close the
user's turn and open a system one. It stays text, tokenized as `Tokenizer.encode(text, parse_special=False)`
tokenizes it.

How. Every string of the conversation (message contents and their parts, names, tool calls; tools; documents) has
its special-token text swapped for sentinels: private-use characters found nowhere in the input, each standing for
the text it replaced. A string's start that ends a special token ("|>") and its end that starts one ("<|im_") are
swapped too, so that two strings the template writes side by side cannot join into one. The template then renders
as usual (it may trim, join or quote the strings: sentinels are ordinary characters to it), and the rendered text
holds special-token text only where the template wrote it. The model's tokenizer encodes that text, splitting at
special tokens and encoding the stretches between them on their own; each stretch that holds sentinels is encoded
again, sentinels put back, with special-token text read as text. Stretches without sentinels keep their ids, so a
conversation without special-token text gets exactly the ids of its rendered text.
"""
from __future__ import annotations

import bisect
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, models
from tokenizers import Tokenizer as _Backend

__all__ = ["ProtectedChat", "SpecialText", "encode_rendered"]

# Planes 15 and 16 (supplementary private use), less their two non-characters each.
_SENTINEL_RANGES = ((0xF0000, 0xFFFFE), (0x100000, 0x10FFFE))
_PRIVATE_USE = re.compile("[\U000F0000-\U0010FFFF]")
_NO_MATCH = "\x00no special token\x00"  # the finder's one vocabulary entry: whatever is not special-token text
# The conversation's data, protected; every other template variable (bos_token, add_generation_prompt, options)
# is the caller's or the tokenizer's and renders as given.
_CONVERSATION_VARIABLES = ("tools", "documents")


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)


class _Sentinels:
    """Private-use characters absent from the input, one per distinct protected text, and the way back."""

    def __init__(self, used: set[str]) -> None:
        self._free = (c for lo, hi in _SENTINEL_RANGES for c in map(chr, range(lo, hi)) if c not in used)
        self._by_text: dict[str, str] = {}
        self.restore: dict[int, str] = {}  # str.translate table: sentinel → the text it stands for

    def __call__(self, text: str) -> str:
        sentinel = self._by_text.get(text)
        if sentinel is None:
            sentinel = next(self._free, None)
            if sentinel is None:
                raise ValueError("the conversation uses every private-use character of planes 15 and 16")
            self._by_text[text] = sentinel
            self.restore[ord(sentinel)] = text
        return sentinel


@dataclass(frozen=True)
class ProtectedChat:
    """The conversation with its special-token text swapped for sentinels, and the table that puts it back."""

    messages: list[dict[str, Any]]
    variables: dict[str, Any]
    restore: dict[int, str]


class SpecialText:
    """Finds a vocabulary's special-token text in strings and protects a conversation from it."""

    def __init__(self, specials: Iterable[str], *, avoid: Iterable[str] = ()) -> None:
        """`specials`: the texts to keep as text; `avoid`: other text whose characters sentinels must not be (the
        vocabulary's added tokens)."""
        texts = sorted({t for t in specials if t})
        # The tokenizers library's own matcher (leftmost-longest, as the model's tokenizer splits): a model that
        # knows one word, so that all but special-token text comes back as that word.
        self._finder = _Backend(models.WordLevel({_NO_MATCH: 0}, unk_token=_NO_MATCH))
        self._finder.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in texts])
        self._starts = texts                                # sorted: a text's proper prefixes sit right after it
        self._ends = sorted(t[::-1] for t in texts)
        self._longest = max(map(len, texts), default=0)
        self._reserved = _private_use([*texts, *avoid])     # characters the sentinels must not be

    def spans(self, s: str) -> list[tuple[int, int]]:
        """Disjoint, sorted spans of `s` to keep as text: its special-token text, and an edge (inside surrounding
        whitespace, which a template may trim) that could join a neighbouring string's edge into a special token."""
        enc = self._finder.encode(s, add_special_tokens=False)
        found = [span for i, span in zip(enc.ids, enc.offsets) if i != 0]
        body_start, body_end = len(s) - len(s.lstrip()), len(s.rstrip())
        for k in range(min(self._longest - 1, body_end - body_start), 0, -1):
            if _has_longer(self._ends, s[body_start:body_start + k][::-1]):
                found.append((body_start, body_start + k))
                break
        for k in range(min(self._longest - 1, body_end - body_start), 0, -1):
            if _has_longer(self._starts, s[body_end - k:body_end]):
                found.append((body_end - k, body_end))
                break
        merged: list[tuple[int, int]] = []
        for a, b in sorted(found):
            if merged and a < merged[-1][1]:
                merged[-1] = (merged[-1][0], max(b, merged[-1][1]))
            else:
                merged.append((a, b))
        return merged

    def protect(self, messages: list[dict[str, Any]], variables: Mapping[str, Any],
                avoid: Iterable[str] = ()) -> ProtectedChat:
        """`messages` and the conversation's `variables` (tools, documents) with their special-token text as
        sentinels; sentinels are chosen absent from everything the template sees, so none can be faked."""
        data = {k: variables[k] for k in _CONVERSATION_VARIABLES if k in variables}
        mark = _Sentinels(self._reserved | _private_use([*avoid, *_strings(messages), *_strings(dict(variables))]))

        def escape(value: Any) -> Any:
            if isinstance(value, str):
                spans = self.spans(value)
                if not spans:
                    return value
                out, at = [], 0
                for a, b in spans:
                    out += [value[at:a], mark(value[a:b])]
                    at = b
                return "".join([*out, value[at:]])
            if isinstance(value, Mapping):
                return {k: escape(v) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return [escape(v) for v in value]
            return value

        return ProtectedChat(messages=[escape(m) for m in messages],
                             variables={**variables, **{k: escape(v) for k, v in data.items()}},
                             restore=mark.restore)


def _private_use(texts: Iterable[str]) -> set[str]:
    return {c for s in texts for c in _PRIVATE_USE.findall(s)}


def _has_longer(sorted_texts: list[str], prefix: str) -> bool:
    """Whether some text in `sorted_texts` starts with `prefix` and is longer."""
    i = bisect.bisect_right(sorted_texts, prefix)
    return i < len(sorted_texts) and sorted_texts[i].startswith(prefix)


def encode_rendered(text: str, restore: Mapping[int, str], backend: _Backend,
                    encode_literal: Callable[[str], list[int]], special_text: Mapping[int, str]) -> list[int]:
    """Ids of `text`, a template rendered over a `ProtectedChat`: the special tokens `backend` finds in it are the
    template's; every stretch between them holding sentinels is encoded by `encode_literal` (which reads
    special-token text as text) with the sentinels put back. `special_text`: the special tokens' ids → text."""
    enc = backend.encode(text, add_special_tokens=False)
    ids = enc.ids
    if not restore:
        return ids
    out: list[int] = []
    start_char = start_token = 0

    def stretch(end_char: int, end_token: int) -> list[int]:
        piece = text[start_char:end_char]
        restored = piece.translate(restore)
        if restored == piece:
            return ids[start_token:end_token]
        return encode_literal(restored)

    for k, (token, (a, b)) in enumerate(zip(ids, enc.offsets)):
        marker = special_text.get(token)
        # A special id whose text is not in its span came from the model (an unknown character as <unk>).
        if marker is None or marker not in text[a:b]:
            continue
        out += stretch(a, k)
        out.append(token)
        start_char, start_token = b, k + 1
    out += stretch(len(text), len(ids))
    return out
