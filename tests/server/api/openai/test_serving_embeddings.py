"""POST /v1/embeddings in-process (the real app and the session's SmolLM2 runner behind httpx's ASGI transport):
a decoder started without --embeddings refuses, and an embedding step that crashes fails its request with a 500
envelope (no internals) while the worker goes on serving."""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

import server.scheduling.loading as model_loading
from engine import Runner
from server.config.settings import Settings
from tests.support import app_harness

MODEL = "smollm2-135m"
SECRET = "boom-secret-internal-detail"


def run_app(settings: Settings, scenario: Callable[[httpx.AsyncClient], Awaitable[None]]) -> None:
    app_harness.run_app(settings, lambda http, app: scenario(http))


@pytest.fixture
def patched(smollm: Runner, monkeypatch: pytest.MonkeyPatch) -> Runner:
    monkeypatch.setattr(model_loading, "load_runner", lambda *a, **k: smollm)
    return smollm


def test_a_decoder_without_the_flag_refuses_embeddings(patched: Runner) -> None:
    async def scenario(http: httpx.AsyncClient) -> None:
        r = await http.post("/v1/embeddings", json={"model": MODEL, "input": "hi"})
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["code"] == "embeddings_not_enabled" and error["param"] == "model"
        assert "--embeddings" in error["message"]

    run_app(Settings(model=MODEL), scenario)


def test_a_crashed_embedding_step_fails_its_request_and_the_worker_goes_on(patched: Runner,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    real, calls = patched.embed, []

    def failing(batch: Any, pooling: Any = None) -> Any:
        calls.append(len(batch))
        if len(calls) == 1:
            raise RuntimeError(SECRET)
        return real(batch, pooling)

    monkeypatch.setattr(patched, "embed", failing)

    async def scenario(http: httpx.AsyncClient) -> None:
        body = {"model": MODEL, "input": ["one", "two"], "encoding_format": "float"}
        held = (await http.get("/health")).json()["kv_blocks_used"]  # the shared runner's own session, if any
        r = await http.post("/v1/embeddings", json=body)
        assert r.status_code == 500 and set(r.json()) == {"error"}
        assert r.json()["error"]["type"] == "server_error" and SECRET not in r.text and "Traceback" not in r.text
        r = await http.post("/v1/embeddings", json=body)
        assert r.status_code == 200 and len(r.json()["data"]) == 2
        health = await http.get("/health")
        assert health.status_code == 200 and health.json()["kv_blocks_used"] == held

    run_app(Settings(model=MODEL, embeddings=True), scenario)
