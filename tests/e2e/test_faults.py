"""Faults stay with the requests they belong to, through a real server process with faults planted in its runner
(tests/support/faulty_server.py): a refused row fails only its request (400), a crashed step only the requests in it
(500) while the server goes on, and a dead worker makes /health unhealthy and the server exit."""
from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest

from tests.support.server_process import EXACT, ServerProcess, health_while_exiting, start_server, stop_server

MODEL = "smollm2-135m"
LAUNCHER = (str(Path(__file__).resolve().parents[1] / "support" / "faulty_server.py"),)


def _chat(content: str, max_tokens: int, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, **extra}


async def _stream(client: httpx.AsyncClient, body: dict) -> tuple[str, list[dict]]:
    """(content, error events) of one streamed chat request."""
    text, errors = "", []
    async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                errors.append(chunk["error"])
                continue
            for choice in chunk["choices"]:
                text += choice["delta"].get("content") or ""
    return text, errors


def _alone(srv: ServerProcess, body: dict) -> str:
    r = httpx.post(f"{srv.base_url}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def _idle(srv: ServerProcess, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        h = httpx.get(f"{srv.base_url}/health", timeout=10).json()
        if h["running"] == 0 and h["queued"] == 0:
            return h
        assert time.monotonic() < deadline, h
        time.sleep(0.1)


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory):
    srv = start_server(tmp_path_factory.mktemp("faulty"), "--model", MODEL, *EXACT, entry=LAUNCHER)
    yield srv
    stop_server(srv)


def test_a_refused_row_fails_only_its_own_request(faulty: ServerProcess) -> None:
    good = _chat("Tell me about the sea.", 40)
    expected = _alone(faulty, good)

    async def run():
        async with httpx.AsyncClient(base_url=faulty.base_url, timeout=300) as client:
            streaming = asyncio.create_task(_stream(client, good))
            await asyncio.sleep(0.5)  # running when the bad one arrives
            bad = await client.post("/v1/chat/completions", json=_chat("FAULT_ROW please", 40))
            return await streaming, bad

    (text, errors), bad = asyncio.run(run())
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"]["message"] == "planted: the runner refuses this row"
    assert errors == [] and text == expected
    assert _idle(faulty)["kv_blocks_used"] == 0


def test_a_crashed_step_fails_its_request_and_the_server_goes_on(faulty: ServerProcess) -> None:
    """The crash comes after 3 streamed tokens and fails that request with an error event (500, no internals);
    the next requests get exactly what they get before. (That a crash fails only the step's requests, not those
    waiting, is tests/server/scheduling/test_scheduler.py's test_a_crashed_step_fails_only_the_requests_in_it.)"""
    good = _chat("Tell me about the moon.", 20)
    expected = _alone(faulty, good)

    async def run():
        async with httpx.AsyncClient(base_url=faulty.base_url, timeout=300) as client:
            return await _stream(client, _chat("FAULT_CRASH now", 50))

    crash_text, crash_errors = asyncio.run(run())
    assert crash_text  # tokens came before the crash
    assert len(crash_errors) == 1 and crash_errors[0]["type"] == "server_error", crash_errors
    assert "planted" not in json.dumps(crash_errors)  # no internals leak
    assert _alone(faulty, good) == expected
    h = _idle(faulty)
    assert h["status"] == "ok" and h["kv_blocks_used"] == 0
    assert "planted crash in the forward pass" in faulty.log()  # logged with its traceback


def test_a_dead_worker_makes_health_unhealthy_and_the_server_exit(tmp_path: Path) -> None:
    srv = start_server(tmp_path, "--model", MODEL, *EXACT, entry=LAUNCHER)
    try:
        r = httpx.post(f"{srv.base_url}/v1/chat/completions", json=_chat("FAULT_FATAL", 10), timeout=60)
        assert r.status_code == 500, r.text
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        health = health_while_exiting(srv.base_url)  # until the process is gone, /health says why it is unhealthy
        if health is not None:
            assert health["status"] == "unhealthy" and "PlantedFatalFault" in health["error"]
        assert srv.process.wait(timeout=30) == 4
        log = srv.log()
        assert "worker-0 stopped serving: PlantedFatalFault: planted fatal fault" in log
    finally:
        stop_server(srv)
