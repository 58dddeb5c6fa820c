"""A real emberserve process (uvicorn on a free 127.0.0.1 port, the real SmolLM2 model) and clients for it."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from engine.tokenizer.tokenizer import Tokenizer
from engine.registry import KNOWN_MODELS
from engine.weights.gguf import read_gguf_metadata
from tests.support.reasoning_model import serving, serving_r1, thinking_model
from tests.support.server_process import EXACT, ServerProcess, start_server, stop_server

MODEL = "smollm2-135m"


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    # --embeddings: the suite's server also embeds (test_embeddings.py), which changes nothing of its generations
    srv = start_server(tmp_path_factory.mktemp("server"), "--model", MODEL, *EXACT, "--embeddings")
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
    from tests.support.greedy_reference import Reference

    return Reference(smollm)


# ---- a tiny reasoning model (tests.support.reasoning_model), for the tests of thinking in every API ----

@pytest.fixture(scope="session")
def thinking_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return thinking_model(tmp_path_factory.mktemp("thinking"))


@pytest.fixture(scope="session")
def r1_server(tmp_path_factory: pytest.TempPathFactory, thinking_model_dir: Path) -> Iterator[ServerProcess]:
    """The reasoning model with a template that opens the thinking in the prompt (--chat-template)."""
    with serving_r1(tmp_path_factory.mktemp("r1"), thinking_model_dir) as srv:
        yield srv


@pytest.fixture(scope="session")
def qwen3_server(tmp_path_factory: pytest.TempPathFactory, thinking_model_dir: Path) -> Iterator[ServerProcess]:
    """The reasoning model with its own (Qwen3's) template, which honours enable_thinking."""
    with serving(tmp_path_factory.mktemp("qwen3"), thinking_model_dir) as srv:
        yield srv
