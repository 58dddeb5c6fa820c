"""Every generation of a request stops when its client goes away, at any moment, and a multi-prompt completion
streams its prompts' choices interleaved as they come. Through the session's real server process."""
from __future__ import annotations

import json
import socket
import time
from typing import Any

import httpx
import pytest

MODEL = "smollm2-135m"
PROMPTS = ["Once upon a time", "The history of the city", "In the beginning", "Dear diary,"]
STOP_WITHIN_S = 5.0  # generous: a step on a shared 2-core machine can take a while


def health(http: httpx.Client) -> dict[str, Any]:
    r = http.get("/health", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def wait_idle(http: httpx.Client, timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        h = health(http)
        if h["running"] == 0 and h["queued"] == 0:
            return h
        assert time.monotonic() < deadline, f"still busy: {h}"
        time.sleep(0.05)


def assert_stopped(http: httpx.Client, before: int, max_tokens: int) -> None:
    """Within STOP_WITHIN_S nothing runs, no KV block is held, and no more tokens come; far fewer were made
    than the requests asked for."""
    h = wait_idle(http, STOP_WITHIN_S)
    assert h["kv_blocks_used"] == 0, h
    time.sleep(0.5)
    again = health(http)
    assert again["generated_tokens"] == h["generated_tokens"] and again["running"] == 0, (h, again)
    assert again["generated_tokens"] - before < max_tokens, (before, again)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_multi_prompt_completion_stops_every_prompt_when_the_client_leaves(base_url: str, http: httpx.Client,
                                                                             stream: bool) -> None:
    before = wait_idle(http)["generated_tokens"]
    body = {"model": MODEL, "prompt": PROMPTS, "max_tokens": 1500, "ignore_eos": True, "stream": stream}
    sock = _raw_stream_request(base_url, "/v1/completions", body)
    if stream:
        _read_until(sock, b"data: {")
    deadline = time.monotonic() + 60
    while health(http)["generated_tokens"] < before + 8:  # they really are generating, every prompt
        assert time.monotonic() < deadline
        time.sleep(0.05)
    sock.close()  # ... and the client goes away, mid-stream or while waiting for the whole answer
    assert_stopped(http, before, 4 * 1500)


def _raw_stream_request(base_url: str, path: str, body: dict) -> socket.socket:
    host, port = base_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    payload = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


def _read_until(sock: socket.socket, marker: bytes) -> bytes:
    data = b""
    while marker not in data:
        chunk = sock.recv(4096)
        assert chunk, data
        data += chunk
    return data


def test_a_chat_stream_stops_when_the_client_leaves_after_the_role_chunk(base_url: str, http: httpx.Client) -> None:
    before = wait_idle(http)["generated_tokens"]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": 1500,
            "ignore_eos": True, "stream": True, "n": 2}
    sock = _raw_stream_request(base_url, "/v1/chat/completions", body)
    data = _read_until(sock, b'"role":"assistant"')  # the first event: the role chunk
    assert b"HTTP/1.1 200" in data
    sock.close()
    assert_stopped(http, before, 2 * 1500)


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Write a long story."}]}),
    ("/v1/completions", {"prompt": PROMPTS}),
], ids=["chat", "completions"])
def test_a_stream_stops_when_the_client_leaves_before_the_first_event(base_url: str, http: httpx.Client,
                                                                      path: str, body: dict) -> None:
    before = wait_idle(http)["generated_tokens"]
    sock = _raw_stream_request(base_url, path, {"model": MODEL, "max_tokens": 1500, "ignore_eos": True,
                                                "stream": True, **body})
    sock.close()  # before any answer
    time.sleep(0.5)
    assert_stopped(http, before, 4 * 1500)


def test_a_multi_prompt_stream_interleaves_its_choices(client, http: httpx.Client) -> None:
    """Two prompts, two choices each: chunks of all four choices arrive mixed, as they are made, not one prompt
    after the other; each choice's text equals the non-streamed answer's."""
    args = dict(model=MODEL, prompt=PROMPTS[:2], max_tokens=12, temperature=0, n=2, extra_body={"ignore_eos": True})
    whole = client.completions.create(**args)
    order, texts = [], {}
    for chunk in client.completions.create(**args, stream=True):
        for choice in chunk.choices:
            order.append(choice.index)
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert sorted(set(order)) == [0, 1, 2, 3]
    assert order != sorted(order), order  # not choice after choice
    assert order.index(2) < len(order) - order[::-1].index(0) - 1  # prompt 1 started before prompt 0 ended
    assert [texts[i] for i in range(4)] == [c.text for c in sorted(whole.choices, key=lambda c: c.index)]
    wait_idle(http)
