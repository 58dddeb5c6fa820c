"""Production operation of a real server: API key (Bearer or x-api-key), CORS, body and prompt limits, request ids, JSON request logs,
and the graceful SIGTERM drain, all through real HTTP and the official client."""
from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.support.server_process import MODEL, ServerProcess, start_server, stop_server

API_KEY = "sk-test-7d1c0ffee-not-a-real-key"
ORIGIN = "https://app.example.com"
BODY_LIMIT = 4096
PROMPT_LIMIT = 64
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4}


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One server with every guard on: the key from the environment, the rest as flags."""
    srv = start_server(tmp_path_factory.mktemp("secured"), "--model", MODEL, "--allowed-origins", ORIGIN,
                       "--max-request-bytes", str(BODY_LIMIT), "--max-prompt-tokens", str(PROMPT_LIMIT),
                       "--log-format", "json", "--log-level", "debug", env={"EMBERSERVE_API_KEY": API_KEY})
    yield srv
    stop_server(srv)


def _client(srv: ServerProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key=key, max_retries=0, timeout=60)


def _json_lines(srv: ServerProcess) -> list[dict[str, Any]]:
    return [json.loads(line) for line in srv.log().splitlines() if line.strip()]


def test_the_right_key_is_served_and_every_other_answer_is_a_401_envelope(secured: ServerProcess) -> None:
    reply = _client(secured, API_KEY).chat.completions.create(**CHAT)
    assert reply.choices[0].message.content
    with pytest.raises(openai.AuthenticationError) as wrong:
        _client(secured, API_KEY + "x").chat.completions.create(**CHAT)
    assert wrong.value.status_code == 401
    assert wrong.value.body == {"message": "Incorrect API key provided.", "type": "authentication_error",
                                "param": None, "code": "invalid_api_key"}
    for headers in ({}, {"Authorization": API_KEY}, {"Authorization": f"Basic {API_KEY}"}):
        r = httpx.get(f"{secured.base_url}/v1/models", headers=headers)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(f"{secured.base_url}/tokenize", json={"prompt": "hi"})
    assert r.status_code == 401


def test_x_api_key_is_honoured_like_the_bearer_key_with_anthropics_401_on_messages(secured: ServerProcess) -> None:
    def claude(key: str) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=secured.base_url, api_key=key, max_retries=0, timeout=60)

    hello = [{"role": "user", "content": "Say hello."}]
    reply = claude(API_KEY).messages.create(model=MODEL, max_tokens=4, messages=hello)  # sends x-api-key
    assert reply.content[0].text
    with pytest.raises(anthropic.AuthenticationError) as wrong:
        claude(API_KEY + "x").messages.create(model=MODEL, max_tokens=4, messages=hello)
    assert wrong.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                           "message": "Incorrect API key provided."}}
    r = httpx.post(f"{secured.base_url}/v1/messages/count_tokens", json={"model": MODEL, "messages": hello})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    # Either header, on any route; a wrong one beside the right one does not lock the client out.
    assert httpx.get(f"{secured.base_url}/v1/models", headers={"x-api-key": API_KEY}).status_code == 200
    both = {"x-api-key": "wrong", "Authorization": f"Bearer {API_KEY}"}
    assert httpx.get(f"{secured.base_url}/v1/models", headers=both).status_code == 200
    r = httpx.get(f"{secured.base_url}/v1/models", headers={"x-api-key": API_KEY + "x"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_probes_and_metrics_stay_open_and_count_auth_failures(secured: ServerProcess) -> None:
    assert httpx.get(f"{secured.base_url}/health").status_code == 200
    assert httpx.get(f"{secured.base_url}/livez").json() == {"status": "alive"}
    httpx.get(f"{secured.base_url}/v1/models")  # one more 401
    metrics = httpx.get(f"{secured.base_url}/metrics")
    assert metrics.status_code == 200
    line = next(l for l in metrics.text.splitlines() if l.startswith('emberserve:request_failure_total{error_type="authentication_error"}'))
    assert float(line.split()[-1]) >= 1


def test_the_key_is_never_logged(secured: ServerProcess) -> None:
    _client(secured, API_KEY).models.list()
    log = secured.log()
    assert "settings: " in log  # the debug line with every setting was written...
    assert API_KEY not in log and API_KEY[8:20] not in log  # ...without the key


def test_cors_answers_allowed_origins_only(secured: ServerProcess, base_url: str) -> None:
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    ok = httpx.options(f"{secured.base_url}/v1/chat/completions", headers={"Origin": ORIGIN, **preflight})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    bad = httpx.options(f"{secured.base_url}/v1/chat/completions",
                        headers={"Origin": "https://evil.example", **preflight})
    assert bad.status_code == 400 and "access-control-allow-origin" not in bad.headers
    simple = httpx.get(f"{secured.base_url}/v1/models", headers={"Origin": ORIGIN,
                                                                  "Authorization": f"Bearer {API_KEY}"})
    assert simple.headers["access-control-allow-origin"] == ORIGIN
    # The session server has no --allowed-origins: CORS is off.
    off = httpx.options(f"{base_url}/v1/chat/completions", headers={"Origin": ORIGIN, **preflight})
    assert "access-control-allow-origin" not in off.headers


def test_bodies_over_the_limit_get_a_413_with_or_without_a_length(secured: ServerProcess) -> None:
    auth = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    big = json.dumps({**CHAT, "messages": [{"role": "user", "content": "a" * BODY_LIMIT}]}).encode()
    r = httpx.post(f"{secured.base_url}/v1/chat/completions", content=big, headers=auth)
    assert r.status_code == 413
    assert r.json()["error"] == {"message": f"the request body is larger than this server's limit of {BODY_LIMIT} "
                                            "bytes", "type": "invalid_request_error", "param": None,
                                 "code": "request_too_large"}

    def chunks(data: bytes) -> Iterator[bytes]:  # no Content-Length: chunked transfer encoding
        for i in range(0, len(data), 1000):
            yield data[i:i + 1000]

    r = httpx.post(f"{secured.base_url}/v1/chat/completions", content=chunks(big), headers=auth)
    assert r.status_code == 413
    small = json.dumps(CHAT).encode()
    r = httpx.post(f"{secured.base_url}/v1/chat/completions", content=chunks(small), headers=auth)
    assert r.status_code == 200, r.text


def test_prompts_over_the_token_limit_get_a_400(secured: ServerProcess) -> None:
    client = _client(secured, API_KEY)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**{**CHAT, "messages": [{"role": "user", "content": "word " * 100}]})
    assert err.value.body["code"] == "prompt_too_long" and err.value.body["param"] == "messages"
    assert f"at most {PROMPT_LIMIT}" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=list(range(1, PROMPT_LIMIT + 2)), max_tokens=1)
    assert err.value.body["param"] == "prompt"
    assert client.completions.create(model=MODEL, prompt=list(range(1, PROMPT_LIMIT + 1)), max_tokens=1).choices


def test_request_ids_are_honoured_or_made_and_each_request_logs_one_json_line(secured: ServerProcess) -> None:
    client = _client(secured, API_KEY)
    raw = client.chat.completions.with_raw_response.create(**CHAT, extra_headers={"X-Request-Id": "trace-42.a"})
    assert raw.headers["x-request-id"] == "trace-42.a"
    reply = raw.parse()
    made = httpx.get(f"{secured.base_url}/health").headers["x-request-id"]
    assert len(made) == 32 and int(made, 16) >= 0
    odd = httpx.get(f"{secured.base_url}/health", headers={"X-Request-Id": "bad id\twith spaces"})
    assert odd.headers["x-request-id"] != "bad id\twith spaces"

    assert httpx.get(f"{secured.base_url}/v1/models", headers={"X-Request-Id": "refused-1"}).status_code == 401
    mine = secured.access_records(1, request_id="trace-42.a")
    assert secured.access_records(1, request_id="refused-1")[0]["status"] == 401
    lines = _json_lines(secured)  # every line the server wrote is one JSON object
    assert len(mine) == 1
    line = mine[0]
    assert line["status"] == 200 and line["model"] == MODEL and line["path"] == "/v1/chat/completions"
    assert line["prompt_tokens"] == reply.usage.prompt_tokens
    assert line["output_tokens"] == reply.usage.completion_tokens
    assert line["finish_reason"] == reply.choices[0].finish_reason
    assert 0 < line["ttft_ms"] <= line["duration_ms"]
    refused = [l for l in lines if l.get("status") == 401]
    assert refused and all(l["logger"] == "emberserve.access" for l in refused)


def test_streamed_requests_are_logged_when_the_stream_ends(secured: ServerProcess) -> None:
    client = _client(secured, API_KEY)
    stream = client.chat.completions.create(**{**CHAT, "max_tokens": 6}, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_headers={"X-Request-Id": "stream-7"})
    usage = [c.usage for c in stream if c.usage is not None][-1]
    mine = secured.access_records(1, request_id="stream-7")
    assert mine[0]["output_tokens"] == usage.completion_tokens == 6
    assert mine[0]["finish_reason"] == "length"


# --- SIGTERM ---------------------------------------------------------------------------------------------------

def _stream_in_thread(srv: ServerProcess, max_tokens: int, result: dict[str, Any], started: threading.Event) -> None:
    client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    chunks: list[Any] = []
    try:
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Tell a long story."}], max_tokens=max_tokens,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        for chunk in stream:
            chunks.append(chunk)
            if chunk.choices and chunk.choices[0].delta.content:
                started.set()
    except Exception as e:  # noqa: BLE001 - the test inspects what happened
        result["error"] = e
    finally:
        started.set()
        result["chunks"] = chunks


def _sigterm_during_a_stream(tmp_path, grace: str, max_tokens: int
                             ) -> tuple[ServerProcess, threading.Thread, dict[str, Any]]:
    """A server with `grace`, a stream of `max_tokens` read in a thread, and SIGTERM once its first text came."""
    srv = start_server(tmp_path, "--model", MODEL, "--shutdown-grace", grace)
    result: dict[str, Any] = {}
    started = threading.Event()
    reader = threading.Thread(target=_stream_in_thread, args=(srv, max_tokens, result, started))
    reader.start()
    assert started.wait(60)
    result["sigterm_at"] = time.monotonic()
    srv.process.send_signal(signal.SIGTERM)
    return srv, reader, result


def test_sigterm_drains_a_stream_in_flight_then_exits_0(tmp_path) -> None:
    srv, reader, result = _sigterm_during_a_stream(tmp_path, "60", 200)
    time.sleep(0.3)
    health = httpx.get(f"{srv.base_url}/health")
    assert health.status_code == 503 and health.json() == {"status": "draining"}
    with pytest.raises(openai.APIStatusError) as refused:
        openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="x", max_retries=0).chat.completions.create(**CHAT)
    assert refused.value.status_code == 503 and refused.value.body["code"] == "shutting_down"
    assert srv.process.wait(timeout=90) == 0
    reader.join(10)
    assert "error" not in result, result.get("error")
    finishes = [c.choices[0].finish_reason for c in result["chunks"] if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert result["chunks"][-1].usage.completion_tokens == 200  # the whole stream came through
    assert "drained: no request in flight" in srv.log()


def test_sigterm_past_the_grace_period_cuts_the_stream_and_still_exits_0(tmp_path) -> None:
    srv, reader, result = _sigterm_during_a_stream(tmp_path, "1", 5000)
    try:
        assert srv.process.wait(timeout=30) == 0
    except subprocess.TimeoutExpired:
        srv.process.kill()
        raise
    assert time.monotonic() - result["sigterm_at"] < 10
    reader.join(30)
    assert not any(c.choices and c.choices[0].finish_reason for c in result["chunks"])  # cut, never finished
    assert "grace period over" in srv.log()


def test_a_second_server_start_reads_the_environment(tmp_path) -> None:
    """Every setting can come from EMBERSERVE_* (here the served name and the context cap), flags win."""
    srv = start_server(tmp_path, "--model", MODEL, "--max-context", "512",
                       env={"EMBERSERVE_SERVED_MODEL_NAME": "from-env", "EMBERSERVE_MAX_CONTEXT": "256"})
    try:
        card = httpx.get(f"{srv.base_url}/v1/models").json()["data"][0]
        assert card["id"] == "from-env" and card["max_model_len"] == 512
    finally:
        stop_server(srv)
