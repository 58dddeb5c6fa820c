"""Prompt lookup: constructed cases, and an incremental index against a brute-force search of the whole sequence."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from server.speculative.ngram import NgramIndex


def brute_force(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The rule, searched from scratch: longest n first, the most recent earlier occurrence of the last n-gram."""
    for n in range(max_n, min_n - 1, -1):
        if n > len(tokens) - 1:
            continue
        suffix = tokens[-n:]
        for end in range(len(tokens) - 2, n - 2, -1):
            if tokens[end - n + 1:end + 1] == suffix:
                period = len(tokens) - 1 - end
                # the text as if it went on repeating its last `period` tokens
                extended = tokens + [tokens[len(tokens) - period + i % period] for i in range(k)]
                return extended[end + 1:end + 1 + k]
    return []


@pytest.mark.parametrize("tokens, k, expected", [
    ([1, 2, 3, 4, 9, 1, 2, 3], 3, [4, 9, 1]),       # the 3-gram [1, 2, 3] recurs: what followed it
    ([1, 2, 3, 9, 2, 3, 8, 2, 3], 2, [8, 2]),        # [2, 3] twice before: the most recent one
    ([1, 2, 3, 9, 2, 3, 8, 5, 3], 4, [8, 5, 3, 8]),  # only [3] recurs; past the end the period-3 repeat goes on
    ([7, 1, 2, 5, 1, 2, 6, 2], 2, [6, 2]),           # [2] last ended at 5: its continuation runs into the suffix
    ([5, 6, 7, 8], 3, []),                           # nothing recurs
    ([4, 4], 3, [4, 4, 4]),                          # the suffix never matches itself; a loop goes on
])
def test_constructed_proposals(tokens: list[int], k: int, expected: list[int]) -> None:
    assert NgramIndex(1, 4).propose(tokens, k) == expected
    assert brute_force(tokens, k, 1, 4) == expected


def test_longer_ngrams_win_over_more_recent_shorter_ones() -> None:
    # [8, 1] last occurred at the start (followed by 2); the 1-gram [1] more recently (followed by 3).
    tokens = [8, 1, 2, 0, 1, 3, 9, 8, 1]
    assert NgramIndex(1, 4).propose(tokens, 1) == [2]
    assert NgramIndex(1, 1).propose(tokens, 1) == [3]


def test_min_n_ignores_shorter_matches() -> None:
    tokens = [1, 2, 3, 9, 2, 3, 8, 5, 3]
    assert NgramIndex(2, 4).propose(tokens, 3) == []
    with pytest.raises(ValueError):
        NgramIndex(3, 2)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=40), st.lists(st.integers(1, 6), min_size=1, max_size=6),
       st.integers(1, 3), st.integers(0, 2), st.integers(1, 5))
def test_incremental_index_equals_brute_force(tokens: list[int], cuts: list[int], min_n: int, extra: int,
                                              k: int) -> None:
    """Proposals at growing prefixes of the sequence (as a decoding sequence calls it) equal a fresh search."""
    index, length = NgramIndex(min_n, min_n + extra), 0
    for cut in cuts + [len(tokens)]:
        length = min(len(tokens), length + cut)
        assert index.propose(tokens[:length], k) == brute_force(tokens[:length], k, min_n, min_n + extra)
