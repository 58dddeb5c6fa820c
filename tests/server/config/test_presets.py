"""Generation presets: valid profiles, the precedence rule against a brute-force model of it (request fields, the
request's preset, the server's, the model's defaults), `--preset` / `EMBERSERVE_PRESET`, `emberserve presets`, the
README table, and a real app with `--preset` on the session's SmolLM2 (chat, responses, an unknown name)."""
from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

import server.scheduling.loading as model_loading
from engine import KNOWN_MODELS, Runner
from server.launch.cli import main
from server.api.metrics import ServerMetrics
from server.config.presets import PRESETS, SAMPLING_FIELDS, get_preset, presets_table
from server.api.openai.protocol import ChatCompletionRequest, CompletionRequest
from server.sampling.params import SamplingParams
from server.api.openai.serving import OpenAIServing
from server.scheduling.model_state import ModelState, ServedModel
from server.config.settings import Settings
from tests.support import app_harness
from tests.support.greedy_reference import Reference

MODEL = "smollm2-135m"
README = Path(__file__).resolve().parents[3] / "README.md"
NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
MINE = {"temperature": 0.33, "top_p": 0.77, "top_k": 7, "min_p": 0.11, "repetition_penalty": 1.23}
ASK = [{"role": "user", "content": "Name three colors."}]


def test_every_preset_is_a_valid_request_and_recommends_a_known_generator() -> None:
    assert list(PRESETS) == ["fast", "balanced", "quality", "creative", "code", "precise"]
    for preset in PRESETS.values():
        values = preset.sampling()
        assert set(values) == set(SAMPLING_FIELDS)
        ChatCompletionRequest.model_validate({"model": MODEL, "messages": ASK, "max_tokens": preset.max_tokens,
                                              **values})
        SamplingParams(**values)
        model = KNOWN_MODELS[preset.model]
        assert model.is_generator and model.memory_mib and preset.description
    assert PRESETS["precise"].temperature == 0.0  # greedy: reproducible
    with pytest.raises(ValueError, match="the presets are fast, balanced, quality, creative, code, precise"):
        get_preset("nope")


def test_every_preset_recommends_a_chat_tuned_model() -> None:
    """The presets are chat profiles: a base model (gemma3-270m continues "What is the capital of France?" with
    more text, it does not answer) or an encoder must never be what one recommends."""
    for preset in PRESETS.values():
        model = KNOWN_MODELS[preset.model]
        assert model.chat_tuned and model.kind == "chat", f"preset {preset.name} recommends {model.name}, a " \
                                                          f"{model.kind} model"


def _serving(runner: Runner, server_preset: str | None) -> OpenAIServing:
    state = ModelState(model_id=MODEL, model=ServedModel.of(runner), pool=None, fingerprint="fp", created=0,  # type: ignore[arg-type]
                       preset=PRESETS[server_preset] if server_preset else None)
    return OpenAIServing(state, ServerMetrics(lambda: None))


def _expected(field: str, sets: dict[str, Any], request: str | None, server: str | None) -> Any:
    """The rule, written out: the request's value, its preset's, the server's preset's, the model's, neutral."""
    if field in sets:
        return sets[field]
    for name in (request, server):
        if name is not None:
            return getattr(PRESETS[name], field)
    return KNOWN_MODELS[MODEL].generation_defaults.get(field, NEUTRAL[field])


def test_sampling_values_follow_the_precedence_rule(smollm: Runner) -> None:
    subsets = [c for k in range(len(MINE) + 1) for c in itertools.combinations(MINE, k)]
    for server in (None, "fast", "creative"):
        serving = _serving(smollm, server)
        for request, fields in itertools.product((None, "code", "precise"), subsets):
            sets = {f: MINE[f] for f in fields}
            body = {"model": MODEL, "messages": ASK, **sets} | ({"preset": request} if request else {})
            params = serving.sampling_params(ChatCompletionRequest.model_validate(body), False, 0)
            for field in SAMPLING_FIELDS:
                assert getattr(params, field) == _expected(field, sets, request, server), (server, request, sets)


def test_the_budget_is_the_requests_then_the_presets_clipped_to_the_context(smollm: Runner) -> None:
    context = smollm.context_size
    for server, request in itertools.product((None, "fast"), (None, "quality")):
        serving = _serving(smollm, server)
        preset = PRESETS[request or server] if (request or server) else None
        extra = {"preset": request} if request else {}
        chat = ChatCompletionRequest.model_validate({"model": MODEL, "messages": ASK, **extra})
        cut = ChatCompletionRequest.model_validate({"model": MODEL, "messages": ASK, "max_tokens": 5, **extra})
        text = CompletionRequest.model_validate({"model": MODEL, "prompt": "Hi", **extra})
        budgets = ("max_completion_tokens", "max_tokens")
        assert serving.completion_budget(cut, 10, *budgets) == 5
        assert serving.completion_budget(chat, 10, *budgets) == (preset.max_tokens if preset else context - 10)
        assert serving.completion_budget(chat, context - 3, *budgets) == 3  # clipped to what the context leaves
        assert serving.completion_budget(text, 10, "max_tokens") == (preset.max_tokens if preset else 16)


def test_the_preset_setting_from_flag_and_environment(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("EMBERSERVE_PRESET", "Creative")
    assert Settings().preset == "creative"
    assert Settings(preset="code").preset == "code"
    with pytest.raises(ValidationError, match="'fast', 'balanced', 'quality', 'creative', 'code' or 'precise'"):
        Settings(preset="nope")
    monkeypatch.delenv("EMBERSERVE_PRESET")
    assert main(["serve", "--preset", "nope"]) == 2  # Settings' validation, as for the variable: one line
    err = capsys.readouterr().err
    assert err.startswith("error: --preset / EMBERSERVE_PRESET:") and "'creative'" in err and err.count("\n") == 1


def test_emberserve_presets_lists_them_and_the_readme_has_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["presets"]) == 0
    out = capsys.readouterr().out.splitlines()
    for preset in PRESETS.values():
        row = next(line for line in out if line.startswith(preset.name + " "))
        assert preset.model in row and f"{preset.max_tokens}" in row
    assert presets_table() in README.read_text(), "regenerate with: python -c 'from server.config.presets import " \
                                                  "presets_table; print(presets_table())'"


def run_app(settings: Settings, scenario: Callable[[httpx.AsyncClient], Awaitable[None]]) -> None:
    app_harness.run_app(settings, lambda http, app: scenario(http))


def test_a_server_started_with_a_preset_serves_its_values(smollm: Runner, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_loading, "load_runner", lambda *a, **k: smollm)
    ref = Reference(smollm)
    expected = ref.text(ref.generate(ref.chat_ids(ASK), 8))  # before the worker owns the runner

    async def scenario(http: httpx.AsyncClient) -> None:
        r = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 8})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == expected  # greedy
        body = {"model": MODEL, "input": "Hi", "max_output_tokens": 2}
        plain = (await http.post("/v1/responses", json=body)).json()
        assert (plain["temperature"], plain["top_p"]) == (0.0, 1.0)  # precise's
        own = (await http.post("/v1/responses", json={**body, "preset": "creative"})).json()
        assert (own["temperature"], own["top_p"]) == (PRESETS["creative"].temperature, PRESETS["creative"].top_p)
        set_ = (await http.post("/v1/responses", json={**body, "preset": "creative", "top_p": 0.5})).json()
        assert set_["top_p"] == 0.5
        bad = await http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "preset": "warm"})
        assert bad.status_code == 400 and set(bad.json()) == {"error"}
        error = bad.json()["error"]
        assert error["param"] == "preset" and error["type"] == "invalid_request_error"
        assert all(name in error["message"] for name in PRESETS)

    run_app(Settings(model=MODEL, preset="precise"), scenario)
