"""Failures inside the worker, in-process: the real app and runner, with the runner made to fail mid-generation.

Over HTTP there is no way to make the worker fail, so the app runs here behind httpx's ASGI transport, with
`load_runner` patched to hand it the session's SmolLM2 runner and its batched `step` patched to raise after a
few forward passes. A failure after the stream started must arrive as a `data: {"error": ...}` event, then `data: [DONE]`;
before the response started, as a 500 envelope; never with a traceback; and the worker must keep serving.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import anthropic
import httpx
import httpx2
import openai
import pytest

import server.scheduling.loading as model_loading
from server.api.state import app_state
from engine import ContextLengthError, Runner
from server.config.settings import Settings
from tests.support import app_harness

MODEL = "smollm2-135m"
SECRET = "boom-secret-internal-detail"
FAIL_AFTER = 3  # forward passes (the prefill, then decode steps) that succeed before the failure
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Count to fifty."}], "max_tokens": 12,
        "ignore_eos": True, "temperature": 0}
COMPLETION = {"model": MODEL, "prompt": "One, two, three,", "max_tokens": 12, "ignore_eos": True, "temperature": 0}


class Failure:
    """Makes the runner's `step` raise `exc` after FAIL_AFTER calls while `on`."""

    def __init__(self, runner: Runner, exc: Exception) -> None:
        self.real = runner.step
        self.exc, self.on, self.calls, self.raised = exc, True, 0, 0

    def __call__(self, rows, *feed):
        self.calls += 1
        if self.on and self.calls > FAIL_AFTER:
            self.raised += 1
            raise self.exc
        return self.real(rows, *feed)


@pytest.fixture
def failing(smollm: Runner, monkeypatch: pytest.MonkeyPatch) -> Callable[[Exception], Failure]:
    monkeypatch.setattr(model_loading, "load_runner", lambda *a, **k: smollm)

    def install(exc: Exception) -> Failure:
        failure = Failure(smollm, exc)
        monkeypatch.setattr(smollm, "step", failure)
        return failure

    return install


def run_app(scenario: Callable[[httpx.AsyncClient, Any], Awaitable[None]]) -> None:
    """Run the app's lifespan (which 'loads' the patched runner and starts its worker), then `scenario`."""
    app_harness.run_app(Settings(model=MODEL), scenario)


def assert_no_internals(text: str) -> None:
    assert "Traceback" not in text and 'File "' not in text, text
    assert SECRET not in text, text


def assert_envelope(error: dict[str, Any]) -> None:
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert error["code"] is None or isinstance(error["code"], str)


def sse_data(body: str) -> list[str]:
    return [line.removeprefix("data:").strip() for line in body.splitlines() if line.startswith("data:")]


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)],
                         ids=["chat", "completions"])
def test_failure_mid_stream_is_an_error_event_then_done(failing, path: str, body: dict) -> None:
    failure = failing(RuntimeError(SECRET))

    async def scenario(http: httpx.AsyncClient, app) -> None:
        r = await http.post(path, json={**body, "stream": True})
        assert r.status_code == 200  # the stream had started: the status is already sent
        assert_no_internals(r.text)
        data = sse_data(r.text)
        assert data[-1] == "[DONE]", data
        events = [json.loads(d) for d in data[:-1]]
        assert "error" not in events[0] and events[0]["choices"], events  # real chunks came before the failure
        assert all("error" not in e for e in events[:-1]), events
        error = events[-1]
        assert set(error) == {"error"}, error
        assert_envelope(error["error"])
        assert error["error"]["type"] == "server_error"
        assert failure.raised == 1
        # Counted once as a failure, though no error handler sees it, and not as a client that left.
        metric = app_state(app).metrics.registry.get_sample_value
        assert metric("emberserve:request_failure_total", {"error_type": "server_error"}) == 1
        assert metric("emberserve:request_success_total", {"finished_reason": "abort"}) == 0
        # The worker survives and serves the next request.
        failure.on = False
        ok = await http.post(path, json=body)
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["completion_tokens"] == body["max_tokens"]
        for _ in range(200):  # the worker marks itself idle just after its last event
            if app_state(app).model.pool.running == 0:
                break
            await asyncio.sleep(0.01)
        assert app_state(app).model.pool.running == 0

    run_app(scenario)


def test_failure_mid_stream_raises_in_openai_client(failing) -> None:
    failing(RuntimeError(SECRET))

    async def scenario(http: httpx.AsyncClient, app) -> None:
        client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", max_retries=0, http_client=http)
        stream = await client.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=12,
                                                      temperature=0, stream=True, extra_body={"ignore_eos": True})
        chunks = []
        with pytest.raises(openai.APIError) as e:
            async for chunk in stream:
                chunks.append(chunk)
        assert chunks and chunks[0].choices[0].delta.role == "assistant"  # it failed mid-stream, not at the start
        assert isinstance(e.value.body, dict) and e.value.body["type"] == "server_error"
        assert e.value.message == e.value.body["message"]
        assert_no_internals(json.dumps(e.value.body))

    run_app(scenario)


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)],
                         ids=["chat", "completions"])
def test_failure_without_stream_is_a_500_envelope(failing, path: str, body: dict) -> None:
    failure = failing(RuntimeError(SECRET))

    async def scenario(http: httpx.AsyncClient, app) -> None:
        r = await http.post(path, json=body)
        assert r.status_code == 500, r.text
        assert_no_internals(r.text)
        assert set(r.json()) == {"error"}
        assert_envelope(r.json()["error"])
        assert r.json()["error"]["type"] == "server_error"
        failure.on = False
        ok = await http.post(path, json=body)
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["completion_tokens"] == body["max_tokens"]
        metric = app_state(app).metrics.registry.get_sample_value
        assert metric("emberserve:request_failure_total", {"error_type": "server_error"}) == 1
        assert metric("emberserve:request_success_total", {"finished_reason": "length"}) == 1

    run_app(scenario)


def test_failure_without_stream_raises_internal_server_error_in_openai_client(failing) -> None:
    failure = failing(RuntimeError(SECRET))

    async def scenario(http: httpx.AsyncClient, app) -> None:
        client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", max_retries=0, http_client=http)
        with pytest.raises(openai.InternalServerError) as e:
            await client.completions.create(model=MODEL, prompt="One, two,", max_tokens=12, temperature=0,
                                            extra_body={"ignore_eos": True})
        assert e.value.status_code == 500 and e.value.type == "server_error"
        assert_no_internals(json.dumps(e.value.body))
        failure.on = False
        ok = await client.completions.create(model=MODEL, prompt="One, two,", max_tokens=5, temperature=0,
                                             extra_body={"ignore_eos": True})
        assert ok.usage.completion_tokens == 5

    run_app(scenario)


def test_engine_error_mid_generation_is_a_400_with_its_message(failing) -> None:
    """An EngineError carries a message meant for the user: it is passed on, as a client error."""
    failing(ContextLengthError("sequence would exceed the context"))

    async def scenario(http: httpx.AsyncClient, app) -> None:
        r = await http.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 400, r.text
        assert_envelope(r.json()["error"])
        assert r.json()["error"]["type"] == "invalid_request_error"
        assert "sequence would exceed the context" in r.json()["error"]["message"]

    run_app(scenario)


def test_unexpected_exception_in_a_route_is_a_500_envelope(failing, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug outside the worker (here: the chat template step) answers the envelope, not a traceback."""
    failing(RuntimeError(SECRET)).on = False

    def broken(*args, **kwargs):
        raise KeyError(SECRET)

    monkeypatch.setattr("server.api.openai.chat.chat_prompt_ids", broken)

    async def scenario(http: httpx.AsyncClient, app) -> None:
        r = await http.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 500, r.text
        assert_no_internals(r.text)
        assert_envelope(r.json()["error"])
        assert r.json()["error"]["type"] == "server_error"
        ok = await http.post("/v1/completions", json=COMPLETION)
        assert ok.status_code == 200, ok.text

    run_app(scenario)


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)],
                         ids=["chat", "completions"])
def test_unexpected_exception_mid_stream_is_an_error_event_then_done(
        failing, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, path: str, body: dict) -> None:
    """A bug in the streaming code itself (here: building the usage chunk), after the 200 went out: the stream
    still ends with a 500 error event and [DONE] rather than a dropped connection, and the traceback is logged."""
    failing(RuntimeError(SECRET)).on = False

    def broken(self, *args):
        raise KeyError(SECRET)

    monkeypatch.setattr("server.api.openai.serving.OpenAIServing.usage", broken)

    async def scenario(http: httpx.AsyncClient, app) -> None:
        r = await http.post(path, json={**body, "stream": True, "stream_options": {"include_usage": True}})
        assert r.status_code == 200
        assert_no_internals(r.text)
        data = sse_data(r.text)
        assert data[-1] == "[DONE]", data
        events = [json.loads(d) for d in data[:-1]]
        assert events[0]["choices"] and all("error" not in e for e in events[:-1]), events
        assert set(events[-1]) == {"error"}, events[-1]
        assert_envelope(events[-1]["error"])
        assert events[-1]["error"]["type"] == "server_error"
        metric = app_state(app).metrics.registry.get_sample_value
        assert metric("emberserve:request_failure_total", {"error_type": "server_error"}) == 1

    run_app(scenario)
    logged = [r for r in caplog.records if r.getMessage().startswith("unhandled error while streaming")]
    assert len(logged) == 1 and logged[0].exc_info is not None and SECRET in str(logged[0].exc_info[1])


# The Responses and Anthropic streams end a failure with their API's own `error` event (no [DONE]).
RESPONSES = {"model": MODEL, "input": "Count to fifty.", "max_output_tokens": 12, "temperature": 0}
MESSAGES = {"model": MODEL, "messages": [{"role": "user", "content": "Count to fifty."}], "max_tokens": 12,
            "temperature": 0}


def named_events(body: str) -> list[tuple[str, dict[str, Any]]]:
    names = [line.removeprefix("event:").strip() for line in body.splitlines() if line.startswith("event:")]
    return list(zip(names, [json.loads(d) for d in sse_data(body)], strict=True))


@pytest.mark.parametrize("path,body", [("/v1/responses", RESPONSES), ("/v1/messages", MESSAGES)],
                         ids=["responses", "messages"])
def test_failure_mid_stream_is_the_apis_error_event(failing, path: str, body: dict) -> None:
    failure = failing(RuntimeError(SECRET))

    async def scenario(http: httpx.AsyncClient, app) -> None:
        r = await http.post(path, json={**body, "stream": True})
        assert r.status_code == 200
        assert_no_internals(r.text)
        events = named_events(r.text)
        assert [name for name, _ in events] == [data["type"] for _, data in events]
        assert events[-1][0] == "error" and all(name != "error" for name, _ in events[:-1]), events
        assert any("delta" in name for name, _ in events), events  # text came before the failure
        error = events[-1][1]
        if path == "/v1/responses":  # the published error event, numbered in the stream's sequence
            assert set(error) == {"type", "sequence_number", "code", "message", "param"}, error
            assert error["sequence_number"] == len(events) - 1 and error["message"], error
        else:  # Anthropic's envelope
            assert set(error) == {"type", "error"} and set(error["error"]) == {"type", "message"}, error
            assert error["error"]["type"] == "api_error" and error["error"]["message"], error
        assert failure.raised == 1
        metric = app_state(app).metrics.registry.get_sample_value
        assert metric("emberserve:request_failure_total", {"error_type": "server_error"}) == 1
        failure.on = False
        ok = await http.post(path, json=body)
        assert ok.status_code == 200, ok.text

    run_app(scenario)


def test_failures_reach_the_anthropic_client_as_its_errors(failing) -> None:
    failure = failing(RuntimeError(SECRET))

    async def scenario(http: httpx.AsyncClient, app) -> None:
        # The anthropic client speaks through httpx2, httpx's successor: its own ASGI transport to the same app.
        transport = httpx2.ASGITransport(app=app, raise_app_exceptions=False)
        claude = anthropic.AsyncAnthropic(base_url="http://test", api_key="unused", max_retries=0,
                                          http_client=httpx2.AsyncClient(transport=transport, timeout=60))
        with pytest.raises(anthropic.InternalServerError) as unstreamed:
            await claude.messages.create(model=MODEL, max_tokens=12, messages=MESSAGES["messages"])
        assert unstreamed.value.status_code == 500
        assert set(unstreamed.value.body) == {"type", "error"}
        assert unstreamed.value.body["error"]["type"] == "api_error"
        texts, failure.calls = [], 0  # the next failure FAIL_AFTER passes into the stream
        with pytest.raises(anthropic.APIStatusError) as streamed:
            async with claude.messages.stream(model=MODEL, max_tokens=12, messages=MESSAGES["messages"]) as stream:
                async for text in stream.text_stream:
                    texts.append(text)
        assert texts  # it failed mid-stream, not at the start
        assert streamed.value.body["error"]["type"] == "api_error"
        assert_no_internals(json.dumps(streamed.value.body))

    run_app(scenario)
