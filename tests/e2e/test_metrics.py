"""GET /metrics: Prometheus text with vLLM's metric names (prefix `emberserve:`), moved exactly by real requests.

Other tests share the session server and may run first, so every check compares two scrapes, never absolute values.
"""
from __future__ import annotations

import asyncio
import time

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from server.api.app import create_app
from server.config.settings import Settings

MODEL = "smollm2-135m"
P = "emberserve:"
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_hit_rate")


def parse(text: str) -> Samples:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def scrape(http: httpx.Client) -> Samples:
    r = http.get("/metrics")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4"), r.headers
    return parse(r.text)


def value(samples: Samples, name: str, **labels: str) -> float:
    """A sample's value; a labelled series not created yet reads 0."""
    return samples.get((P + name, tuple(sorted(labels.items()))), 0.0)


def idle(http: httpx.Client, timeout: float = 30) -> Samples:
    """A scrape once nothing runs or waits, so that work left by earlier tests cannot move the figures."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(http)
        if value(samples, "num_requests_running") == 0 and value(samples, "num_requests_waiting") == 0:
            return samples
        assert time.monotonic() < deadline, "the server did not become idle"
        time.sleep(0.05)


def test_metrics_answers_with_the_gauges(http: httpx.Client) -> None:
    samples = idle(http)
    for name in GAUGES:
        assert (P + name, ()) in samples, name
    assert 0 <= value(samples, "kv_cache_usage_perc") <= 1
    assert 0 <= value(samples, "prefix_cache_hit_rate") <= 1
    # At rest they agree with /health, which reads the same worker figures.
    health = http.get("/health").json()
    assert value(samples, "kv_cache_usage_perc") == health["kv_blocks_used"] / health["kv_blocks_total"]
    queried = health["prefix_cache_queried_tokens"]
    assert value(samples, "prefix_cache_hit_rate") == (health["prefix_cache_hit_tokens"] / queried if queried else 0)


def test_requests_move_the_metrics_exactly(client: openai.OpenAI, http: httpx.Client) -> None:
    before = idle(http)
    started = time.perf_counter()
    completion = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5,
                                           temperature=0, extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Write a poem about the sea."}], max_tokens=7,
        temperature=0, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    bad = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                                  "max_tokens": -1})
    elapsed = time.perf_counter() - started
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error", bad.text
    after = idle(http)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    usages = [completion.usage, chunks[-1].usage]
    assert [u.completion_tokens for u in usages] == [5, 7]
    assert completion.choices[0].finish_reason == "length"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert delta("generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert delta("prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("request_success_total", finished_reason="length") == 2
    assert delta("request_success_total", finished_reason="stop") == 0
    assert delta("request_success_total", finished_reason="abort") == 0
    assert delta("request_failure_total", error_type="invalid_request_error") == 1
    assert delta("time_to_first_token_seconds_count") == 2
    assert delta("e2e_request_latency_seconds_count") == 2
    assert delta("inter_token_latency_seconds_count") == sum(u.completion_tokens - 1 for u in usages)
    # Each request's first token came before its end, and all of it within the test's own time.
    assert 0 < delta("time_to_first_token_seconds_sum") < delta("e2e_request_latency_seconds_sum") <= 2 * elapsed
    assert 0 < delta("inter_token_latency_seconds_sum") < elapsed
    # A histogram's buckets are cumulative: +Inf holds every observation.
    assert delta("e2e_request_latency_seconds_bucket", le="+Inf") == 2


def test_each_choice_counts_as_a_sequence(client: openai.OpenAI, http: httpx.Client) -> None:
    """With n = 2 each choice is counted as vLLM counts the children of a parallel-sampling request."""
    before = idle(http)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=3,
                                       n=2, temperature=0.8, seed=1, extra_body={"ignore_eos": True})
    after = idle(http)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert r.usage.completion_tokens == 6
    assert delta("generation_tokens_total") == 6
    assert delta("prompt_tokens_total") == r.usage.prompt_tokens  # one prompt, computed once
    assert delta("request_success_total", finished_reason="length") == 2
    assert delta("time_to_first_token_seconds_count") == 2
    assert delta("inter_token_latency_seconds_count") == 4


def test_a_client_that_leaves_mid_stream_counts_as_abort(http: httpx.Client, base_url: str) -> None:
    before = idle(http)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=base_url, timeout=60) as c, c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:"):  # the first token came; closing the connection now leaves mid-stream
                break
    deadline = time.monotonic() + 30
    while True:
        after = scrape(http)
        aborted = value(after, "request_success_total", finished_reason="abort") - \
            value(before, "request_success_total", finished_reason="abort")
        if aborted or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert aborted == 1
    assert value(after, "request_success_total", finished_reason="length") == \
        value(before, "request_success_total", finished_reason="length")
    assert value(after, "time_to_first_token_seconds_count") - value(before, "time_to_first_token_seconds_count") == 1


def test_metrics_answer_while_loading_and_apps_do_not_clash() -> None:
    """No model yet (the lifespan that loads it does not run here): gauges read 0 and errors are counted per app."""

    async def main() -> None:
        apps = [create_app(Settings(model=MODEL)) for _ in range(2)]  # a shared registry would refuse the second
        transports = [httpx.ASGITransport(app=app) for app in apps]
        async with httpx.AsyncClient(transport=transports[0], base_url="http://test") as first, \
                httpx.AsyncClient(transport=transports[1], base_url="http://test") as second:
            r = await first.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"})
            assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable", r.text
            assert (await first.get("/health")).status_code == 503
            for http, failures in ((first, 1), (second, 0)):
                r = await http.get("/metrics")
                assert r.status_code == 200, r.text
                samples = parse(r.text)
                assert all(value(samples, name) == 0 for name in GAUGES), samples
                assert (P + "kv_cache_usage_perc", ()) in samples
                assert value(samples, "request_failure_total", error_type="service_unavailable") == failures

    asyncio.run(main())
