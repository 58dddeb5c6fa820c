"""Continuous batching, the paged KV cache and the bounded queue, through real server processes.

Each request's expected output is what the same request gets when it runs alone on the same server: batching,
chunked prefill, prefix-cache hits and preemption must not change what a request receives.
"""
from __future__ import annotations

import asyncio
import time
import uuid

import httpx
import pytest

from tests.support.server_process import EXACT, start_server, stop_server

MODEL = "smollm2-135m"
TOPICS = ["the sea", "a dragon", "winter", "a robot", "coffee", "the moon", "a library", "trains"]


def _request(i: int) -> dict:
    """16 different requests: half greedy, half sampled with a seed and varied parameters."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"Write about {TOPICS[i % 8]}."}],
            "max_tokens": 24, "ignore_eos": True, "stream": True}
    if i % 2:
        body |= {"temperature": 0.7 + 0.05 * (i % 5), "top_p": 0.9, "top_k": 20 + i, "seed": 1000 + i,
                 "frequency_penalty": 0.2 * (i % 3)}
    else:
        body |= {"temperature": 0}
    return body


async def _stream(client: httpx.AsyncClient, body: dict, cancel_after: int | None = None) -> str:
    """The streamed content of one chat request; with `cancel_after`, disconnect after that many chunks."""
    import json

    text, chunks = "", 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                text += choice["delta"].get("content") or ""
            chunks += 1
            if cancel_after is not None and chunks >= cancel_after:
                return text
    return text


def _health(base_url: str) -> dict:
    return httpx.get(f"{base_url}/health", timeout=10).json()


def _wait_idle(base_url: str, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        h = _health(base_url)
        if h["running"] == 0 and h["queued"] == 0:
            return h
        time.sleep(0.2)
    raise AssertionError(f"server still busy: {_health(base_url)}")


def test_concurrent_requests_get_what_they_get_alone(base_url: str) -> None:
    bodies = [_request(i) for i in range(8)]  # every topic once: four greedy, four sampled with their own seeds

    async def run() -> tuple[list[str], list[str]]:
        async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
            alone = [await _stream(client, b) for b in bodies]
            together = await asyncio.gather(*(_stream(client, b) for b in bodies))
        return alone, list(together)

    alone, together = asyncio.run(run())
    assert all(alone), alone
    for i, (a, t) in enumerate(zip(alone, together)):
        assert t == a, f"request {i} ({'sampled' if i % 2 else 'greedy'}) differs when batched"
    assert _wait_idle(base_url)["kv_blocks_used"] == 0


def test_prefix_cache_hit_equals_cold(base_url: str, http: httpx.Client) -> None:
    nonce = uuid.uuid4().hex  # a prefix no earlier request can have cached
    system = f"Session {nonce}. You are a careful assistant who answers in full sentences. " * 6
    body = {"model": MODEL, "max_tokens": 20, "temperature": 0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Name a color."}]}
    cold = http.post("/v1/chat/completions", json=body).json()
    warm = http.post("/v1/chat/completions", json=body).json()
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
    prompt_tokens = warm["usage"]["prompt_tokens"]
    # every whole 16-token block of the prompt but the one holding its last token comes from the cache
    assert cached == (prompt_tokens - 1) // 16 * 16 and cached >= 64
    assert warm["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]
    other = {**body, "messages": [body["messages"][0], {"role": "user", "content": "Name an animal."}]}
    shared = http.post("/v1/chat/completions", json=other).json()
    assert shared["usage"]["prompt_tokens_details"]["cached_tokens"] >= cached - 16


def test_cancelling_half_frees_every_block(base_url: str) -> None:
    bodies = [{**_request(i), "max_tokens": 80} for i in range(16)]

    async def run() -> list[str]:
        async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
            return await asyncio.gather(*(_stream(client, b, cancel_after=3 if i % 2 else None)
                                          for i, b in enumerate(bodies)))

    texts = asyncio.run(run())
    assert all(texts[i] for i in range(0, 16, 2))
    health = _wait_idle(base_url, timeout=120)
    assert health["kv_blocks_used"] == 0, health


@pytest.fixture(scope="module")
def tight_server(tmp_path_factory: pytest.TempPathFactory):
    """A server whose KV pool holds 256 tokens and whose batches hold 64 tokens: it must chunk and preempt."""
    srv = start_server(tmp_path_factory.mktemp("tight"), "--model", MODEL, *EXACT, "--kv-cache-memory",
                       str(46080 * 256), "--max-batched-tokens", "64", "--no-prefix-cache")
    yield srv
    stop_server(srv)


def test_preemption_and_chunked_prefill_keep_outputs(tight_server, base_url: str) -> None:
    bodies = [{**_request(i), "max_tokens": 40} for i in range(0, 12, 2)]  # greedy, ~35-token prompts

    async def run(url: str, together: bool) -> list[str]:
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            if together:
                return list(await asyncio.gather(*(_stream(client, b) for b in bodies)))
            return [await _stream(client, b) for b in bodies]

    reference = asyncio.run(run(base_url, together=False))  # the default server, one at a time
    got = asyncio.run(run(tight_server.base_url, together=True))
    assert got == reference
    health = _wait_idle(tight_server.base_url)
    assert health["preemptions"] > 0, health  # 6 x ~75 tokens do not fit in 256
    assert health["kv_blocks_used"] == 0
    assert health["prefix_cache_hit_tokens"] == 0  # --no-prefix-cache


def test_full_queue_answers_429(tmp_path_factory: pytest.TempPathFactory) -> None:
    srv = start_server(tmp_path_factory.mktemp("busy"), "--model", MODEL, *EXACT, "--max-running", "1",
                       "--max-queued", "1")
    try:
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True,
                "temperature": 0}

        async def run() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=srv.base_url, timeout=300) as client:
                first = asyncio.create_task(client.post("/v1/completions", json=body))
                await asyncio.sleep(1.0)  # running
                second = asyncio.create_task(client.post("/v1/completions", json={**body, "max_tokens": 5}))
                await asyncio.sleep(0.5)  # waiting
                third = await client.post("/v1/completions", json=body)
                assert not first.done() and not second.done()
                first.cancel()  # the first client leaves mid-way: its slot goes to the queued one at once
                return [third, await asyncio.wait_for(second, 20)]

        third, second = asyncio.run(run())
        assert third.status_code == 429, third.text
        assert third.headers.get("retry-after")
        error = third.json()["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == "queue_full"
        assert second.status_code == 200
        assert httpx.post(f"{srv.base_url}/v1/completions", json={**body, "max_tokens": 3}).status_code == 200
    finally:
        stop_server(srv)


def test_two_workers_share_the_load(tmp_path_factory: pytest.TempPathFactory, base_url: str) -> None:
    """--workers 2: two runners, each on its own thread, with twice the KV pool; concurrent requests answer as alone."""
    srv = start_server(tmp_path_factory.mktemp("pool"), "--model", MODEL, *EXACT, "--workers", "2")
    try:
        one = _health(srv.base_url)
        assert one["kv_blocks_total"] == 2 * _health(base_url)["kv_blocks_total"]
        bodies = [_request(i) for i in range(0, 8, 2)]  # greedy

        async def run(url: str, together: bool) -> list[str]:
            async with httpx.AsyncClient(base_url=url, timeout=300) as client:
                if together:
                    return list(await asyncio.gather(*(_stream(client, b) for b in bodies)))
                return [await _stream(client, b) for b in bodies]

        assert asyncio.run(run(srv.base_url, together=True)) == asyncio.run(run(base_url, together=False))
        assert _wait_idle(srv.base_url)["generated_tokens"] == 4 * 24
    finally:
        stop_server(srv)
