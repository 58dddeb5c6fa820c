"""A real server with its model split over 2 processes on CPU (`--tensor-parallel-size 2 --device cpu`: gloo), on a
tiny random llama (tests/support/tiny_models.py): concurrent streams through the official client carry what the
single-process engine generates greedily; a rank that dies takes the server down with a clear error, and the
stream it was serving ends rather than hangs."""
from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from engine import load_runner
from tests.support.greedy_reference import Reference
from tests.support.server_process import ServerProcess, start_server, stop_server
from tests.support.tiny_models import build_tiny_model

SERVED = "tiny-tp"
EXIT_WORKER_FAILED = 4  # server/launch/checks.py
QUESTIONS = ["Hello there, how are you today?", "The quick brown fox jumps over the lazy dog.",
             "Numbers like 12 and 345 are split into pieces."]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_model("llama_tied", tmp_path_factory.mktemp("tp-model")).safetensors_dir)


@pytest.fixture(scope="module")
def tp_server(tmp_path_factory: pytest.TempPathFactory, tiny_dir: str) -> Iterator[ServerProcess]:
    srv = start_server(tmp_path_factory.mktemp("tp"), "--model", tiny_dir, "--served-model-name", SERVED,
                       "--tensor-parallel-size", "2", "--device", "cpu", "--dtype", "float32")
    yield srv
    stop_server(srv)


def _messages(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def test_streams_what_one_process_generates(tp_server: ServerProcess, tiny_dir: str) -> None:
    assert "tensor parallel over 2 ranks (gloo)" in tp_server.log()
    client = openai.AsyncOpenAI(base_url=f"{tp_server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)

    async def stream(question: str) -> str:
        chunks = await client.chat.completions.create(model=SERVED, messages=_messages(question), stream=True,
                                                      temperature=0, max_tokens=16)
        return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])

    async def all_at_once() -> list[str]:
        return await asyncio.gather(*(stream(q) for q in QUESTIONS))  # batched together on the ranks

    texts = asyncio.run(all_at_once())
    ref = Reference(load_runner(tiny_dir, dtype="float32"))
    for question, text in zip(QUESTIONS, texts):
        assert text == ref.text(ref.generate(ref.chat_ids(_messages(question)), 16)), question


def test_a_rank_that_dies_takes_the_server_down(tp_server: ServerProcess) -> None:
    """(Last in this module: it ends the module's server.)"""
    pid = int(re.search(r"tensor-parallel rank 1 of 2: pid (\d+)", tp_server.log()).group(1))
    client = openai.OpenAI(base_url=f"{tp_server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    ended = threading.Event()
    outcome: list[str] = []

    def long_stream() -> None:
        try:
            chunks = client.chat.completions.create(model=SERVED, messages=_messages(QUESTIONS[0]), stream=True,
                                                    temperature=0, max_tokens=400, extra_body={"ignore_eos": True})
            finish = None
            for chunk in chunks:
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
            outcome.append(f"finish_reason {finish}")
        except Exception as e:  # noqa: BLE001 - what the client saw is the outcome
            outcome.append(f"{type(e).__name__}: {e}")
        finally:
            ended.set()

    threading.Thread(target=long_stream, daemon=True).start()
    time.sleep(0.5)  # the stream is running
    os.kill(pid, signal.SIGKILL)
    health: list[int] = []
    deadline = time.monotonic() + 30
    while tp_server.process.poll() is None and time.monotonic() < deadline:
        try:
            health.append(httpx.get(f"{tp_server.base_url}/health", timeout=2).status_code)
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    assert tp_server.process.wait(timeout=1) == EXIT_WORKER_FAILED, tp_server.log()
    assert ended.wait(10), "the stream in flight did not end"
    assert all(code == 503 for code in health[1:]), health  # (the first poll may precede the watcher)
    log = tp_server.log()
    assert f"error: worker-0 stopped serving: tensor-parallel rank 1 (pid {pid}) exited with signal SIGKILL" in log
    assert outcome and outcome != ["finish_reason length"], outcome  # cut short, not served in full
