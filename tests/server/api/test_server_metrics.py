"""server/api/metrics.py's GenerationTrack (tests/e2e/test_metrics.py scrapes a real server's): what one generation's
events add to the latency histograms and token counters."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from server.scheduling.generation import ChoiceDelta
from server.api.metrics import PREFIX, ServerMetrics


def _sample(metrics: ServerMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(f"{PREFIX}{name}", labels)
    return 0.0 if value is None else value


def test_tokens_sent_together_share_the_interval_since_the_last_ones() -> None:
    """A chunk of 4 tokens 80 ms after the last one (a stream interval of 4): four intervals of 20 ms, not one of
    80 ms and three of 0."""
    metrics = ServerMetrics(lambda: None)
    track = metrics.track(SimpleNamespace(arrival=10.0, prompt_ids=[1, 2, 3], n=1))
    track.observe(ChoiceDelta(0, "a", [5], at=10.05))          # the first token, alone
    track.observe(ChoiceDelta(0, "bcde", [6, 7, 8, 9], at=10.13))
    track.observe(ChoiceDelta(0, "f", [10], finish_reason="length", at=10.14))
    itl = "inter_token_latency_seconds"
    assert _sample(metrics, "time_to_first_token_seconds_sum") == pytest.approx(0.05)
    assert _sample(metrics, f"{itl}_count") == 5 and _sample(metrics, f"{itl}_sum") == pytest.approx(0.09)
    assert _sample(metrics, f"{itl}_bucket", le="0.0075") == 0  # no token came "at once"
    assert _sample(metrics, f"{itl}_bucket", le="0.01") == 1    # the last one, 10 ms after
    assert _sample(metrics, f"{itl}_bucket", le="0.025") == 5   # the four of the chunk, 20 ms each
    assert _sample(metrics, "generation_tokens_total") == 6 and _sample(metrics, "prompt_tokens_total") == 3
    assert _sample(metrics, "request_success_total", finished_reason="length") == 1


def test_tokens_that_came_with_the_first_add_no_interval() -> None:
    """A reader that fell behind gets its first tokens merged: the first is timed to the first token, the others
    (made in steps whose times this side never saw) count as tokens with no interval of their own."""
    metrics = ServerMetrics(lambda: None)
    track = metrics.track(SimpleNamespace(arrival=1.0, prompt_ids=[1], n=1))
    track.observe(ChoiceDelta(0, "abc", [5, 6, 7], at=1.5))
    assert _sample(metrics, "time_to_first_token_seconds_count") == 1
    assert _sample(metrics, "inter_token_latency_seconds_count") == 2
    assert _sample(metrics, "inter_token_latency_seconds_sum") == 0
    assert _sample(metrics, "generation_tokens_total") == 3
