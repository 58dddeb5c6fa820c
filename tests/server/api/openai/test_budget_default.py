"""--max-tokens-default: the output budget of a request that sets none, on every endpoint (chat, completions,
Responses, and the Generator through the same preparation); a request's own budget and a preset's win over it."""
from __future__ import annotations

from typing import Any

import httpx
import pytest

import server.scheduling.loading as model_loading
from engine import Runner
from server.config.settings import Settings
from tests.support.app_harness import run_app

MODEL = "smollm2-135m"
ASK = [{"role": "user", "content": "Count from one to one hundred, in words."}]


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch, smollm: Runner) -> None:
    monkeypatch.setattr(model_loading, "load_runner", lambda *a, **k: smollm)


def _scenario(results: dict[str, Any]):
    async def scenario(http: httpx.AsyncClient, app) -> None:
        chat = {"model": MODEL, "messages": ASK, "ignore_eos": True, "temperature": 0}
        results["chat"] = (await http.post("/v1/chat/completions", json=chat)).json()
        results["chat_own"] = (await http.post("/v1/chat/completions", json={**chat, "max_tokens": 7})).json()
        results["chat_preset"] = (await http.post("/v1/chat/completions", json={**chat, "preset": "fast"})).json()
        results["completion"] = (await http.post("/v1/completions", json={
            "model": MODEL, "prompt": "One, two, three,", "ignore_eos": True, "temperature": 0})).json()
        results["responses"] = (await http.post("/v1/responses", json={
            "model": MODEL, "input": ASK[0]["content"], "temperature": 0})).json()
    return scenario


def test_a_request_without_a_budget_gets_the_servers_default() -> None:
    results: dict[str, Any] = {}
    # The model loaded with a 64-token context: without the default a chat runs to its end (ignore_eos), soon.
    run_app(Settings(model=MODEL, max_tokens_default=5, max_model_len=64), _scenario(results))
    assert results["chat"]["usage"]["completion_tokens"] == 5, results["chat"]
    assert results["chat"]["choices"][0]["finish_reason"] == "length"
    assert results["chat_own"]["usage"]["completion_tokens"] == 7, results["chat_own"]
    assert results["completion"]["usage"]["completion_tokens"] == 5, results["completion"]
    assert results["responses"]["usage"]["output_tokens"] <= 5, results["responses"]
    # the preset's max_tokens (more than the context leaves) wins over the server's default: the rest of the context
    usage = results["chat_preset"]["usage"]
    assert usage["completion_tokens"] == 64 - usage["prompt_tokens"] > 5, usage


def test_without_the_setting_a_completion_keeps_its_own_16(served: None) -> None:
    """The default stays what clients see today: completions' own 16 (a chat: the rest of the context)."""
    results: dict[str, Any] = {}

    async def scenario(http: httpx.AsyncClient, app) -> None:
        results["completion"] = (await http.post("/v1/completions", json={
            "model": MODEL, "prompt": "One, two, three,", "ignore_eos": True, "temperature": 0})).json()

    run_app(Settings(model=MODEL), scenario)
    assert results["completion"]["usage"]["completion_tokens"] == 16, results["completion"]
