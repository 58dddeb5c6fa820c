"""A client that stops reading its stream does not stall the others: its generation pauses once its reader is far
behind (bounded buffering), and the stream is cut after `--stream-timeout` seconds, freeing its blocks."""
from __future__ import annotations

import json
import socket
import time

import httpx

from tests.support.server_process import start_server, stop_server

MODEL = "smollm2-135m"
TIMEOUT_S = 2


def test_a_client_that_stops_reading_is_cut_and_the_others_stream_on(tmp_path) -> None:
    srv = start_server(tmp_path, "--model", MODEL, "--stream-timeout", str(TIMEOUT_S))
    try:
        host, port = srv.base_url.removeprefix("http://").split(":")
        slow = socket.socket()
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the server's sends block soon
        slow.connect((host, int(port)))
        # The echoed prompt with 20 top logprobs a token is ~0.5 MB an event for each of 4 choices: more than the
        # kernel's socket buffers (~1 MB against a 4 KB window) and uvicorn's hold, so the server's sends block.
        body = json.dumps({"model": MODEL, "prompt": [(7 * i) % 4000 + 100 for i in range(1000)],
                           "max_tokens": 2000, "ignore_eos": True, "stream": True, "echo": True, "logprobs": 20,
                           "n": 4}).encode()
        slow.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        # ... and never reads. Meanwhile another client streams normally.
        started = time.monotonic()
        with httpx.Client(base_url=srv.base_url, timeout=120) as c:
            with c.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "The sea", "max_tokens": 60,
                                                           "ignore_eos": True, "stream": True,
                                                           "stream_options": {"include_usage": True}}) as r:
                events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
            assert events[-1]["usage"]["completion_tokens"] == 60
            fast_took = time.monotonic() - started
            # The slow one is cut: nothing runs, its blocks are free, and it made far fewer than 4000 tokens.
            deadline = time.monotonic() + TIMEOUT_S + 60
            while True:
                h = c.get("/health").json()
                if h["running"] == 0:
                    break
                assert time.monotonic() < deadline, h
                time.sleep(0.2)
            assert h["kv_blocks_used"] == 0, h
            assert h["generated_tokens"] < 60 + 4 * 2000 / 2, h
            time.sleep(1)
            assert c.get("/health").json()["generated_tokens"] == h["generated_tokens"]
        # the server closed the slow connection: reading what is left ends (no hang)
        slow.settimeout(10)
        received = b""
        while chunk := slow.recv(65536):
            received += chunk
        assert received.startswith(b"HTTP/1.1 200")
        assert b"[DONE]" not in received  # cut, not finished
        slow.close()
        assert fast_took < 120, fast_took  # generous: the slow one's prompt steps are big, the machine small
        assert "stream cut" in srv.log() and " ERROR " not in srv.log()
    finally:
        stop_server(srv)
