"""Prompt lookup (n-gram speculation): propose the tokens that followed the last earlier occurrence of the
sequence's final n-gram, in the prompt and the generated text, so no second model is needed (a continuation that
reaches the end of the sequence repeats with the same period: how a loop goes on).

It pays where the output copies its context: editing code, summarising or answering from a long document, RAG.
`NgramIndex` keeps, per n, where each n-gram of the sequence last ended, and is brought up to date with the tokens
appended since the last call, so a proposal costs a few dictionary look-ups whatever the sequence's length.
"""
from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    """Where every n-gram (min_n <= n <= max_n) of one growing token sequence last ended."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n} and {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self._last_end: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self._indexed = 0  # n-grams ending before this position are in the index

    def _index(self, tokens: Sequence[int], upto: int) -> None:
        """Record the n-grams ending at positions [indexed, upto)."""
        for end in range(self._indexed, upto):
            for n, last in self._last_end.items():
                if end + 1 >= n:
                    last[tuple(tokens[end + 1 - n:end + 1])] = end
        self._indexed = max(self._indexed, upto)

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """`k` tokens that followed the most recent earlier occurrence of the last n-gram of `tokens`, for the
        longest n that has one; [] when none recurs. Where that continuation runs into the end of the sequence
        (a repetition, such as a loop the output has fallen into), it goes on repeating with the same period.
        `tokens` must extend those of the previous call."""
        length = len(tokens)
        if length - 1 < self._indexed:  # not an extension of what was indexed: start again
            self.__init__(self.min_n, self.max_n)  # type: ignore[misc]
        # Occurrences end before the last position: the final n-gram never matches itself.
        self._index(tokens, length - 1)
        if k <= 0:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            end = self._last_end[n].get(tuple(tokens[length - n:]))
            if end is not None:
                period = length - 1 - end
                out = list(tokens[end + 1:end + 1 + k])
                while len(out) < k:
                    out.append(out[len(out) - period])
                return out
        return []
