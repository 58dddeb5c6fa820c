"""`--api-server-count 2`: two HTTP processes share the port in front of one engine process (server/launch/http_fronts.py).
Through real server processes: both processes answer requests, whose greedy outputs equal the one-process
server's; /metrics counts every process's requests whichever process a scrape reaches; a stored response is
found by every process (the engine process holds the store); SIGTERM drains all and leaves no process; a killed
HTTP process takes the server down with EXIT_WORKER_FAILED; the setting needs the engine process."""
from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.test_engine_process import EXIT_WITHIN_S, EXIT_WORKER_FAILED, children, engine_pid, wait_gone
from tests.e2e.test_metrics import idle, value
from tests.support.server_process import EXACT, ServerProcess, start_server, stop_server

MODEL = "smollm2-135m"
FRONTS = ("--model", MODEL, *EXACT, "--engine-process", "--api-server-count", "2")


@pytest.fixture(scope="module")
def fronts_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = start_server(tmp_path_factory.mktemp("fronts"), *FRONTS)
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def fronts_http(fronts_server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=fronts_server.base_url, timeout=120) as c:
        yield c


def front_pids(srv: ServerProcess) -> list[int]:
    """The other HTTP processes the server's log names, checked to be children of the server process."""
    match = re.search(r"more HTTP processes serve the port: ([\d, ]+)", srv.log())
    assert match, f"the server does not name its other HTTP processes:\n{srv.log()}"
    pids = [int(p) for p in match.group(1).split(",")]
    assert set(pids) <= children(srv.process.pid), (pids, children(srv.process.pid))
    return pids


def cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


async def _stream_all(base_url: str, prompts: list[str], concurrency: int) -> list[str]:
    """Each prompt streamed (greedy, 24 tokens) over `concurrency` connections of their own; the texts."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=0)  # a new connection each
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as http:
        async def one(prompt: str) -> str:
            async with gate:
                client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", http_client=http,
                                            max_retries=0)
                stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                                         stream=True, extra_body={"ignore_eos": True})
                return "".join([c.choices[0].text async for c in stream if c.choices])

        return await asyncio.gather(*(one(p) for p in prompts))


def test_both_http_processes_serve_and_outputs_equal_the_one_process_servers(
        fronts_server: ServerProcess, client: openai.OpenAI) -> None:
    pids = [fronts_server.process.pid, *front_pids(fronts_server)]
    prompts = [f"Question {i}: what is the colour of the sky at {i} o'clock?" for i in range(48)]
    before = [cpu_ticks(p) for p in pids]
    texts = asyncio.run(_stream_all(fronts_server.base_url, prompts, concurrency=16))
    used = [cpu_ticks(p) - b for p, b in zip(pids, before)]
    # every process took connections: parsing and streaming 48 requests is tens of ticks; an idle one, ~0
    assert all(u >= 5 for u in used), f"CPU ticks per HTTP process during the burst: {used}"
    for i in (0, 17, 47):
        want = client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=24, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text
        assert texts[i] == want, i


def test_metrics_count_every_processs_requests(fronts_server: ServerProcess, fronts_http: httpx.Client) -> None:
    before = idle(fronts_http)
    n = 24
    asyncio.run(_stream_all(fronts_server.base_url, [f"Count {i}" for i in range(n)], concurrency=8))
    for _ in range(6):  # each scrape lands on either process: all must count every request
        after = idle(fronts_http)
        done = value(after, "request_success_total", finished_reason="length") - value(
            before, "request_success_total", finished_reason="length")
        assert done == n, done
        tokens = value(after, "generation_tokens_total") - value(before, "generation_tokens_total")
        assert tokens == n * 24, tokens


def test_a_stored_response_is_found_by_every_process(fronts_server: ServerProcess) -> None:
    # new connections each time, so that both processes are asked
    def http() -> httpx.Client:
        return httpx.Client(base_url=fronts_server.base_url, timeout=60, limits=httpx.Limits(max_keepalive_connections=0))

    with http() as c:
        first = c.post("/v1/responses", json={"model": MODEL, "input": "Say hello.", "max_output_tokens": 8,
                                              "temperature": 0}).json()
        rid = first["id"]
        for _ in range(12):
            got = c.get(f"/v1/responses/{rid}")
            assert got.status_code == 200, got.text
            assert got.json()["output_text"] == first["output_text"]
        follow = c.post("/v1/responses", json={"model": MODEL, "input": "Again.", "max_output_tokens": 4,
                                               "previous_response_id": rid})
        assert follow.status_code == 200, follow.text
        assert c.delete(f"/v1/responses/{rid}").status_code == 200
        for _ in range(6):
            assert c.get(f"/v1/responses/{rid}").status_code == 404


def test_sigterm_drains_every_process_and_leaves_none(tmp_path: Path) -> None:
    srv = start_server(tmp_path, *FRONTS)
    helpers: set[int] = set()
    try:
        fronts, engine = front_pids(srv), engine_pid(srv)
        helpers = children(srv.process.pid)
        with httpx.Client(base_url=srv.base_url, timeout=60) as c, c.stream(
                "POST", "/v1/completions", json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 64,
                                                 "temperature": 0, "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            srv.process.send_signal(signal.SIGTERM)  # mid-stream: the drain lets it finish
            rest = list(lines)
        assert rest[-1] == "data: [DONE]" or "data: [DONE]" in rest, rest[-3:]
        assert srv.process.wait(timeout=EXIT_WITHIN_S) == 0, srv.log()
        assert wait_gone({engine, *fronts}) == set(), srv.log()
        assert wait_gone(helpers) == set(), f"left behind: {helpers}"
        assert "Traceback" not in srv.log(), srv.log()
    finally:
        stop_server(srv)
        for p in wait_gone(helpers, timeout=0):
            os.kill(p, signal.SIGKILL)


def test_a_killed_http_process_takes_the_server_down(tmp_path: Path) -> None:
    srv = start_server(tmp_path, *FRONTS)
    helpers: set[int] = set()
    try:
        (front,), engine = front_pids(srv), engine_pid(srv)
        helpers = children(srv.process.pid)
        os.kill(front, signal.SIGKILL)
        assert srv.process.wait(timeout=EXIT_WITHIN_S) == EXIT_WORKER_FAILED, srv.log()
        assert "HTTP process emberserve-http-1 exited (exit code -9)" in srv.log(), srv.log()
        assert wait_gone({engine}) == set(), srv.log()
        assert "Traceback" not in srv.log(), srv.log()
    finally:
        stop_server(srv)
        for p in wait_gone(helpers, timeout=0):
            os.kill(p, signal.SIGKILL)


def test_more_http_processes_need_the_engine_process() -> None:
    out = subprocess.run([sys.executable, "-m", "server", "serve", "--model", MODEL, "--api-server-count", "2"],
                         capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 2, out
    assert "--engine-process" in out.stderr and "Traceback" not in out.stderr, out.stderr
