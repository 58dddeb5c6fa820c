"""A real emberserve process (uvicorn on a free 127.0.0.1 port, the real SmolLM2 model) and clients for it."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from engine.tokenizer import Tokenizer
from engine.registry import KNOWN_MODELS
from engine.weights.gguf import read_gguf_metadata

MODEL = "smollm2-135m"
STARTUP_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    process: subprocess.Popen
    base_url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def start_server(tmp: Path, *args: str, wait: bool = True) -> ServerProcess:
    """Start `python -m server serve` on a free port; with `wait`, return once /health answers 200."""
    port = free_port()
    log_path = tmp / f"server-{port}.log"
    cmd = [sys.executable, "-m", "server", "serve", "--port", str(port), *args]
    proc = subprocess.Popen(cmd, stdout=log_path.open("wb"), stderr=subprocess.STDOUT,
                            cwd=Path(__file__).resolve().parents[2], env={**os.environ, "PYTHONUNBUFFERED": "1"})
    server = ServerProcess(proc, f"http://127.0.0.1:{port}", log_path)
    if wait:
        wait_ready(server)
    return server


def wait_ready(server: ServerProcess, timeout: float = STARTUP_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"server exited with {server.process.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"server not ready after {timeout}s:\n{server.log()}")


def stop_server(server: ServerProcess) -> None:
    server.process.terminate()
    try:
        server.process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = start_server(tmp_path_factory.mktemp("server"), "--model", MODEL)
    yield srv
    stop_server(srv)


@pytest.fixture(scope="session")
def base_url(server: ServerProcess) -> str:
    return server.base_url


@pytest.fixture(scope="session")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def aclient(base_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def http(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    """The served model's tokenizer, built in the test process, to count and construct tokens independently."""
    return Tokenizer.from_gguf_metadata(read_gguf_metadata(KNOWN_MODELS[MODEL].path()))


@pytest.fixture(scope="session")
def ref(smollm):
    """Greedy decoding by the engine in the test process (same weights as the server)."""
    from greedy_reference import Reference

    return Reference(smollm)
