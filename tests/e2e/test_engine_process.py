"""`--engine-process` on CPU: the model, its scheduler and workers in a child process, the HTTP server talking to
it over a pipe (server/process/client.py). Through real server processes and the official openai client: greedy
outputs (chat and completions, streamed and not, logprobs and prompt logprobs) and embeddings equal the one-process
server's (the session `server`, same model and flags); a client that leaves frees everything in the engine;
structured outputs and their 400s; /health and /metrics read the engine's figures; a killed engine fails its
streams, turns /health unhealthy and makes the server exit non-zero; SIGTERM leaves no engine process behind."""
from __future__ import annotations

import asyncio
import glob
import json
import math
import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import numpy as np
import openai
import pytest

from tests.e2e.test_disconnects import assert_stopped, wait_idle
from tests.e2e.test_metrics import idle, scrape, value
from tests.support.server_process import EXACT, ServerProcess, health_while_exiting, start_server, stop_server

MODEL = "smollm2-135m"
ENGINE = ("--model", MODEL, *EXACT, "--engine-process")
EXIT_WORKER_FAILED = 4  # server/launch/checks.py
EXIT_WITHIN_S = 30.0


# ---- servers, clients, processes ----

@pytest.fixture(scope="module")
def engine_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The suite server's flags (--embeddings too) with the engine in its own process."""
    srv = start_server(tmp_path_factory.mktemp("engine-process"), *ENGINE, "--embeddings")
    yield srv
    stop_server(srv)


def _client(srv: ServerProcess, timeout: float = 120) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0, timeout=timeout)


@pytest.fixture(scope="module")
def engine(engine_server: ServerProcess) -> openai.OpenAI:
    return _client(engine_server)


@pytest.fixture(scope="module")
def engine_http(engine_server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=engine_server.base_url, timeout=120) as c:
        yield c


def children(pid: int) -> set[int]:
    """The live child processes of `pid` (every thread's list)."""
    found: set[int] = set()
    for path in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            found.update(int(p) for p in Path(path).read_text().split())
        except OSError:  # a thread that ended meanwhile
            pass
    return found


def engine_pid(srv: ServerProcess) -> int:
    """The engine process the server's log names, checked to be a child of the server process."""
    match = re.search(r"the engine runs in process (\d+)", srv.log())
    assert match, f"the server does not say where its engine runs:\n{srv.log()}"
    pid = int(match.group(1))
    assert pid != srv.process.pid and pid in children(srv.process.pid), (pid, children(srv.process.pid))
    return pid


def gone(pid: int) -> bool:
    """No process `pid`, or only its zombie (a dead child its parent has not reaped yet)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return re.search(r"^State:\s+Z", status, re.M) is not None


def wait_gone(pids: set[int], timeout: float = 10.0) -> set[int]:
    """Wait until every process of `pids` is gone; return those still there after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        left = {p for p in pids if not gone(p)}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def health(http: httpx.Client) -> dict[str, Any]:
    r = http.get("/health", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


# ---- comparing two servers' answers ----

def assert_same(got: Any, expected: Any, path: str = "") -> None:
    """Equal, floats (logprobs) to 1e-4: the two servers run the same float32 engine, but a prompt one of them has
    cached computes from its cached blocks, in another order of float32 sums (CI saw 1.1e-5 apart); a logprob sent
    for the wrong token or position is off by far more."""
    if isinstance(expected, float) and isinstance(got, float):
        assert math.isclose(got, expected, rel_tol=0, abs_tol=1e-4), f"{path}: {got} != {expected}"
    elif isinstance(expected, dict) and isinstance(got, dict):
        assert got.keys() == expected.keys(), f"{path}: keys {sorted(got)} != {sorted(expected)}"
        for key in expected:
            if path.endswith("prompt_tokens_details") and key == "cached_tokens":
                continue  # what each server's prefix cache holds depends on what it served before
            assert_same(got[key], expected[key], f"{path}.{key}")
    elif isinstance(expected, list) and isinstance(got, list):
        assert len(got) == len(expected), f"{path}: {len(got)} items != {len(expected)}:\n{got}\n{expected}"
        for i, (g, e) in enumerate(zip(got, expected)):
            assert_same(g, e, f"{path}[{i}]")
    else:
        assert got == expected, f"{path}: {got!r} != {expected!r}"


def _whole(response: Any) -> dict[str, Any]:
    return response.model_dump(exclude={"id", "created"})


def _streamed(chunks: list[Any]) -> dict[str, Any]:
    """A stream's choices put together: each index's text, logprob entries and finish, its usage and fingerprint."""
    choices: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for c in chunk.choices:
            d = c.model_dump()
            into = choices.setdefault(c.index, {"text": "", "logprobs": [], "finish_reason": None,
                                                "stop_reason": None})
            delta = d.get("delta")
            into["text"] += (delta.get("content") or "") if delta is not None else (d.get("text") or "")
            lp = d.get("logprobs")
            if lp is not None and "content" in lp:  # chat: a list of entries
                into["logprobs"] += lp["content"] or []
            elif lp is not None:  # completions: parallel lists
                into["logprobs"] += [list(entry) for entry in zip(lp["tokens"], lp["token_logprobs"],
                                                                  lp["top_logprobs"])]
            if c.finish_reason is not None:
                into["finish_reason"], into["stop_reason"] = c.finish_reason, d.get("stop_reason")
    assert chunks, "an empty stream"
    usage = chunks[-1].usage
    return {"choices": [choices[i] for i in sorted(choices)], "usage": usage.model_dump() if usage else None,
            "fingerprints": sorted({c.system_fingerprint for c in chunks if c.system_fingerprint})}


CHAT_LOGPROBS = dict(messages=[{"role": "user", "content": "Name three colours of the rainbow."}], max_tokens=8,
                     logprobs=True, top_logprobs=3)
CHAT_STREAM_N2 = dict(messages=[{"role": "system", "content": "You answer in verse."},
                                {"role": "user", "content": "Write a haiku about engines."}], max_tokens=10, n=2,
                      stream=True, stream_options={"include_usage": True})
COMPLETIONS_ECHO = dict(prompt=["The engine of a car", "Rivers flow to the"], max_tokens=8, echo=True, logprobs=2)
# sampled, not greedy: the sampling parameters cross the pipe, and a seed draws the same tokens in every process
CHAT_SEEDED = dict(messages=[{"role": "user", "content": "Invent a name for a ship."}], max_tokens=10, temperature=0.9,
                   top_p=0.95, seed=7, frequency_penalty=0.5, logit_bias={"30": -5}, n=2)
COMPLETIONS_STREAM = dict(prompt="A short list of fruits:", max_tokens=14, logprobs=1, stop=["."], stream=True,
                          stream_options={"include_usage": True})


def _chat(client: openai.OpenAI, body: dict[str, Any]) -> dict[str, Any]:
    out = client.chat.completions.create(model=MODEL, **{"temperature": 0, **body})
    return _streamed(list(out)) if body.get("stream") else _whole(out)


def _completions(client: openai.OpenAI, body: dict[str, Any]) -> dict[str, Any]:
    out = client.completions.create(model=MODEL, temperature=0, **body)
    return _streamed(list(out)) if body.get("stream") else _whole(out)


@pytest.mark.parametrize("ask, body", [
    (_chat, CHAT_LOGPROBS), (_chat, CHAT_STREAM_N2), (_chat, CHAT_SEEDED), (_completions, COMPLETIONS_ECHO),
    (_completions, COMPLETIONS_STREAM),
], ids=["chat-logprobs", "chat-stream-n2", "chat-seeded", "completions-echo-logprobs", "completions-stream-stop"])
def test_outputs_equal_the_one_process_servers(engine: openai.OpenAI, client: openai.OpenAI,
                                                      ask: Callable[[openai.OpenAI, dict], dict], body: dict) -> None:
    """The same request to both servers (greedy, and once seeded sampling): the same text, tokens' logprobs (prompt
    logprobs with echo), finish and stop reasons, usage and system fingerprint (made of the model facts the engine
    process hands over)."""
    expected = ask(client, body)
    got = ask(engine, body)
    assert_same(got, expected)
    # what was compared is really there: text, and logprobs where asked for
    choices = expected["choices"]
    prompts = len(body["prompt"]) if isinstance(body.get("prompt"), list) else 1
    assert len(choices) == prompts * body.get("n", 1), choices
    for choice in choices:
        assert choice["finish_reason"] in ("stop", "length")
        assert (choice.get("text") or choice.get("message", {}).get("content") or "").strip(), choice
        if body.get("logprobs"):  # chat: {"content": [...]}, completions: {"tokens": [...], ...}, streamed: a list
            lp = choice["logprobs"]
            assert (lp.get("content") or lp.get("tokens")) if isinstance(lp, dict) else lp, choice


def test_concurrent_streams_each_get_what_they_get_alone(engine_server: ServerProcess, client: openai.OpenAI,
                                                         engine_http: httpx.Client) -> None:
    """Four streams at once: each step's events for all of them cross the pipe in one message; each stream gets
    its own text, the one-process server's answer to it alone."""
    prompts = ["Tell me about the moon.", "What is a river?", "Count to five.", "Describe a cat."]
    expected = [client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": p}], max_tokens=8,
                                               temperature=0).choices[0].message.content for p in prompts]

    async def stream(aclient: openai.AsyncOpenAI, prompt: str) -> str:
        text = ""
        async for chunk in await aclient.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=8, temperature=0,
                stream=True):
            text += "".join(c.delta.content or "" for c in chunk.choices)
        return text

    async def run() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=f"{engine_server.base_url}/v1", api_key="unused", max_retries=0,
                                     timeout=120)
        async with aclient:
            return await asyncio.gather(*(stream(aclient, p) for p in prompts))

    assert asyncio.run(run()) == expected
    assert wait_idle(engine_http)["kv_blocks_used"] == 0


# ---- a client that leaves ----

def test_a_client_that_leaves_mid_stream_frees_everything_in_the_engine(engine: openai.OpenAI,
                                                                        engine_http: httpx.Client) -> None:
    """Two prompts streamed, the client gone after their first tokens: the cancellations cross the pipe, the
    engine stops both generations and gives their KV blocks back (/health, from the engine's figures)."""
    before = wait_idle(engine_http)["generated_tokens"]
    stream = engine.completions.create(model=MODEL, prompt=["Once upon a time", "In the beginning"], max_tokens=1500,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    seen: set[int] = set()
    for chunk in stream:
        seen.update(c.index for c in chunk.choices if c.text)
        if seen == {0, 1}:
            break
    during = health(engine_http)
    assert during["running"] == 2 and during["kv_blocks_used"] > 0, during  # both really were generating
    stream.close()  # ... and the client goes away
    assert_stopped(engine_http, before, 2 * 1500)
    # and the engine serves on
    out = engine.completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3


# ---- structured outputs ----

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "rank": {"type": "integer", "minimum": 1, "maximum": 5}},
          "required": ["city", "rank"], "additionalProperties": False}


def test_json_schema_output_validates_and_equals_the_one_process_servers(engine: openai.OpenAI,
                                                                         client: openai.OpenAI) -> None:
    """The grammar is compiled in both processes (the HTTP one to answer a bad one with a 400, the engine to mask
    its tokens); the output is valid under the schema and the one-process server's."""
    body = dict(model=MODEL, messages=[{"role": "user", "content": "Give a city and its rank as JSON."}],
                max_tokens=60, temperature=0,
                response_format={"type": "json_schema", "json_schema": {"name": "out", "schema": SCHEMA,
                                                                        "strict": True}})
    got = engine.chat.completions.create(**body).choices[0]
    assert got.finish_reason == "stop", got
    jsonschema.validate(json.loads(got.message.content), SCHEMA)
    assert got.message.content == client.chat.completions.create(**body).choices[0].message.content
    streamed = "".join(c.delta.content or "" for chunk in engine.chat.completions.create(**body, stream=True)
                       for c in chunk.choices)
    assert streamed == got.message.content


def test_an_invalid_schema_gets_a_400_in_the_error_envelope(engine: openai.OpenAI,
                                                            engine_http: httpx.Client) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        engine.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}})
    error = info.value.body
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] == "invalid_request_error" and error["param"] == "response_format.json_schema.schema"
    assert health(engine_http)["status"] == "ok"


# ---- /health and /metrics ----

def test_health_and_metrics_count_a_finished_request(engine: openai.OpenAI, engine_http: httpx.Client) -> None:
    """While a stream runs /health and the gauges show it (asked of the engine over the pipe); once it ends they
    are back at rest and the counters moved by exactly its tokens."""
    before_health, before = wait_idle(engine_http), idle(engine_http)
    stream = engine.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell a story."}],
                                            max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks, checked = [], False
    for chunk in stream:
        chunks.append(chunk)
        if not checked and any(c.delta.content for c in chunk.choices):  # the first token: more are to come
            checked = True
            running = health(engine_http)
            scraped = scrape(engine_http)
            assert running["running"] == 1 and running["kv_blocks_used"] > 0, running
            assert running["generated_tokens"] > before_health["generated_tokens"], running
            assert value(scraped, "num_requests_running") == 1 and value(scraped, "kv_cache_usage_perc") > 0
    assert checked
    usage = chunks[-1].usage
    assert usage.completion_tokens == 12
    after_health, after = wait_idle(engine_http), idle(engine_http)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert after_health["generated_tokens"] - before_health["generated_tokens"] == 12
    assert after_health["kv_blocks_used"] == 0 and after_health["kv_blocks_total"] > 0
    assert after_health["prefix_cache_queried_tokens"] > before_health["prefix_cache_queried_tokens"]
    assert delta("generation_tokens_total") == 12
    assert delta("prompt_tokens_total") == usage.prompt_tokens
    assert delta("request_success_total", finished_reason="length") == 1
    assert delta("time_to_first_token_seconds_count") == 1 and delta("inter_token_latency_seconds_count") == 11
    assert 0 < delta("time_to_first_token_seconds_sum") < delta("e2e_request_latency_seconds_sum") < 60
    assert value(after, "num_requests_running") == 0 and value(after, "kv_cache_usage_perc") == 0
    assert after_health["model"] == MODEL and after_health["dtype"] == "float32" and after_health["device"] == "cpu"


# ---- embeddings ----

TEXTS = ["The cat sat on the mat.", "Embeddings place similar meanings close together.", "ok",
         "Le café est délicieux — 東京 🙂"]


def test_embeddings_equal_the_one_process_servers(engine: openai.OpenAI, client: openai.OpenAI) -> None:
    """The vectors come back over the pipe as tensors: the same as the one-process server's for strings and ids."""
    for inputs in (TEXTS, [[1, 504, 3458, 314], [30, 31, 32]]):
        got = engine.embeddings.create(model=MODEL, input=inputs, encoding_format="float")
        expected = client.embeddings.create(model=MODEL, input=inputs, encoding_format="float")
        assert [d.index for d in got.data] == list(range(len(inputs)))
        vectors = np.array([d.embedding for d in got.data])
        assert vectors.shape == (len(inputs), 576)
        np.testing.assert_allclose(vectors, np.array([d.embedding for d in expected.data]), rtol=0, atol=1e-6)
        assert got.usage.prompt_tokens == expected.usage.prompt_tokens > 0


def test_the_model_entry_comes_over_the_pipe_as_the_one_process_servers(engine_http: httpx.Client,
                                                                         http: httpx.Client) -> None:
    """The HTTP process knows the model only from what the engine process sent (ServedModel): its details too."""
    card, expected = engine_http.get("/v1/models").json()["data"][0], http.get("/v1/models").json()["data"][0]
    assert card["details"]["parameters"] > 0 and card["details"]["chat_tuned"] is True
    assert {**card, "created": 0} == {**expected, "created": 0}


# ---- the engine process's end ----

def test_a_killed_engine_fails_its_stream_and_the_server_exits(tmp_path: Path) -> None:
    """SIGKILL to the engine process while a stream runs: the stream ends with an error event (not a hang), /health
    turns unhealthy (unless the server is already gone) and the server exits with EXIT_WORKER_FAILED, no traceback."""
    srv = start_server(tmp_path, *ENGINE)
    try:
        pid = engine_pid(srv)
        stream = _client(srv, timeout=30).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Write a long story about the sea."}],
            max_tokens=2000, temperature=0, stream=True, extra_body={"ignore_eos": True})
        received, killed = 0, math.inf
        with pytest.raises(openai.APIError) as info:
            for chunk in stream:
                received += 1
                if received == 4:
                    os.kill(pid, signal.SIGKILL)
                    killed = time.monotonic()
        failed_within = time.monotonic() - killed
        # an error event, not a connection cut short or a read timeout
        assert not isinstance(info.value, openai.APIConnectionError), repr(info.value)
        assert info.value.body["type"] == "server_error", info.value.body
        assert failed_within < 10, failed_within
        assert received < 500, received
        body = health_while_exiting(srv.base_url)  # until the process is gone, /health says why it is unhealthy
        if body is not None:
            assert body["status"] == "unhealthy" and "engine process exited" in body["error"], body
        assert srv.process.wait(timeout=EXIT_WITHIN_S) == EXIT_WORKER_FAILED, srv.log()
        log = srv.log()
        assert "the engine process exited (exit code -9)" in log, log
        assert "Traceback" not in log, log
    finally:
        stop_server(srv)


def test_sigterm_while_idle_exits_0_and_leaves_no_engine_process(tmp_path: Path) -> None:
    """SIGTERM to a server that has served and is idle: it stops its engine and exits 0; neither the engine nor
    multiprocessing's resource tracker outlives it."""
    srv = start_server(tmp_path, *ENGINE)
    helpers: set[int] = set()
    try:
        pid = engine_pid(srv)
        helpers = children(srv.process.pid)  # the engine, and multiprocessing's resource tracker
        out = _client(srv).completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0,
                                              extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 3
        srv.process.send_signal(signal.SIGTERM)
        assert srv.process.wait(timeout=EXIT_WITHIN_S) == 0, srv.log()
        assert wait_gone({pid}, timeout=1.0) == set(), f"the engine process {pid} outlived the server"
        assert wait_gone(helpers) == set(), f"left behind: {helpers}"
        assert "Traceback" not in srv.log(), srv.log()
    finally:
        stop_server(srv)
        for p in wait_gone(helpers, timeout=0):  # none, unless the test failed: no orphan left running
            os.kill(p, signal.SIGKILL)
