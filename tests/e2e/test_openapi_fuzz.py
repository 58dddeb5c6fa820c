"""Schemathesis against a real server's own GET /openapi.json: for every route, requests generated from the
document (valid ones, and ones that break it) never get a 5xx, every 4xx is exactly the OpenAI error envelope, and
every response has a status, media type and body the document declares for that route.

The server is a dedicated process (int4 SmolLM2 serving embeddings too, a 256-token context, short prompts, a
short queue) with an API key, which schemathesis sends from the document's security scheme, or breaks (401s).
Valid generation requests are cut to n <= 2 and at most 8 new tokens, so that each costs milliseconds and the
module stays short on two cores (bench/RESULTS.md#issue-32-openapi-fuzz-time); the cuts keep them valid.
"""
from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import Case, GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, negative_data_rejection,
                                               response_schema_conformance, status_code_conformance)

from tests.support.server_process import ServerProcess, start_server, stop_server

# Examples per route and generation mode: valid requests for every route, and invalid ones (a broken body, a
# missing or wrong key) for those that take a key; the probes have one distinct request, so they run once. That is
# 3 + 3 + 3 + (3 + 3) + (3 + 3) + (3 + 3) + (20 + 20) + (150 + 150) * 2 + (60 + 60) + (40 + 40) + (60 + 60)
# = 1030 requests for the chat, completions, embeddings routes and the others, and (60 + 60) * 2 + (10 + 10) * 2
# + (15 + 15) + (30 + 30) = 370 for the Responses and Anthropic routes (their time: bench/RESULTS.md#issue-32-openapi-fuzz-time). The
# summary printed at the end says how many each route ran and which statuses they got.
EXAMPLES = {
    "GET /livez": 3,
    "GET /health": 3,
    "GET /metrics": 3,
    "GET /version": 3,
    "GET /v1/models": 3,
    "GET /v1/presets": 3,
    "GET /v1/models/{model_id}": 20,
    "POST /v1/chat/completions": 150,
    "POST /v1/completions": 150,
    "POST /tokenize": 60,
    "POST /detokenize": 40,
    "POST /v1/responses": 60,
    "GET /v1/responses/{response_id}": 10,
    "DELETE /v1/responses/{response_id}": 10,
    "GET /v1/responses/{response_id}/input_items": 15,
    "POST /v1/messages": 60,
    "POST /v1/messages/count_tokens": 30,
    "POST /v1/embeddings": 60,
}
MODEL = "smollm2-135m"
VOCAB = 49152
MAX_NEW_TOKENS = 8
MAX_N = 2
SERVER_ARGS = ("--max-context", "256", "--max-prompt-tokens", "128", "--max-queued", "8", "--embeddings")
KEY = "fuzz-key"
PROBES = ("GET /livez", "GET /health", "GET /metrics")  # no key needed, no inputs: nothing to break
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection]
GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")
ENVELOPE_KEYS = {"message", "type", "param", "code"}
# The streams of named events (`event:` then `data:` with that `type`), by path: the events that may end them.
NAMED_STREAMS = {"/v1/responses": {"response.completed", "response.incomplete", "error"},
                 "/v1/messages": {"message_stop", "error"}}


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    # One intra-op thread: on a machine whose cores other processes share, OpenMP's barriers make a step of two
    # threads many times slower (seconds per request instead of milliseconds).
    srv = start_server(tmp_path_factory.mktemp("fuzz"), *SERVER_ARGS,
                       env={"OMP_NUM_THREADS": "1", "EMBERSERVE_API_KEY": KEY})
    yield srv
    stop_server(srv)
    log = srv.log()
    errors = [line for line in log.splitlines() if " ERROR " in line]
    traceback = log.find("Traceback")
    assert not errors and traceback < 0, "\n".join(errors) + log[max(0, traceback - 2000):traceback + 4000]


@pytest.fixture(scope="module")
def api(fuzz_server: ServerProcess) -> schemathesis.BaseSchema:
    # Whole streams (schemathesis reads 20 events by default): 8 prompts x 2 choices x 10 events at most here.
    config = schemathesis.Config.from_dict({"auth": {"openapi": {"bearer": {"bearer": KEY}}},
                                            "max-stream-events": 1000})
    return schemathesis.openapi.from_url(f"{fuzz_server.base_url}/openapi.json", config=config,
                                         headers={"Authorization": f"Bearer {KEY}"})


@pytest.fixture(scope="module")
def response_ids(fuzz_server: ServerProcess) -> list[str]:
    """Three stored responses, for the routes that read them (a DELETE may take one away)."""
    ids = []
    for _ in range(3):
        r = requests.post(f"{fuzz_server.base_url}/v1/responses", headers={"Authorization": f"Bearer {KEY}"},
                          json={"model": MODEL, "input": "Hi", "max_output_tokens": 1}, timeout=60)
        assert r.status_code == 200, r.text
        ids.append(r.json()["id"])
    return ids


@pytest.fixture(scope="module")
def session() -> Iterator[requests.Session]:
    with requests.Session() as s:
        yield s


@pytest.fixture(scope="module")
def summary(request: pytest.FixtureRequest) -> Iterator[dict[str, Counter]]:
    """Route -> statuses seen ("200 SSE" for event streams); written to the terminal when the module ends."""
    seen: dict[str, Counter] = {label: Counter() for label in EXAMPLES}
    yield seen
    lines = [f"{label:28} {sum(c.values()):4} examples  " + "  ".join(f"{s}: {n}" for s, n in sorted(c.items()))
             for label, c in seen.items()]
    with request.config.pluginmanager.getplugin("capturemanager").global_and_fixture_disabled():
        print("\n".join(["", "schemathesis examples per route (statuses):", *lines]))


def assert_envelope(body: Any) -> None:
    """Exactly the OpenAI error envelope: {"error": {message, type, param, code}}, code a string or null."""
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert isinstance(error, dict) and set(error) == ENVELOPE_KEYS, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    assert error["param"] is None or isinstance(error["param"], str), error
    assert error["code"] is None or isinstance(error["code"], str), error


def assert_anthropic_envelope(body: Any) -> None:
    """Exactly Anthropic's error envelope: {"type": "error", "error": {type, message}}."""
    assert isinstance(body, dict) and set(body) == {"type", "error"} and body["type"] == "error", body
    error = body["error"]
    assert isinstance(error, dict) and set(error) == {"type", "message"}, error
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str), error


def assert_errors_are_envelopes(response: schemathesis.Response, path: str) -> None:
    """Every error body, and every error event of a stream, is the envelope of the route's API; a chat or
    completions stream ends with [DONE], a stream of named events with its last event."""
    text = response.content.decode("utf-8")
    anthropic = path.startswith("/v1/messages")
    if response.status_code >= 400:
        (assert_anthropic_envelope if anthropic else assert_envelope)(json.loads(text))
    elif response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
        assert not response.stream_cut_short
        # SSE lines end only at CR or LF: str.splitlines() would also cut at U+2028 and the like inside the JSON.
        lines = re.split(r"\r\n|\r|\n", text)
        events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
        if path in NAMED_STREAMS:
            names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
            payloads = [json.loads(event) for event in events]
            assert names == [p["type"] for p in payloads] and names[-1] in NAMED_STREAMS[path], names
            for payload in payloads:
                if payload["type"] == "error":
                    if anthropic:
                        assert_anthropic_envelope(payload)
                    else:
                        assert set(payload) == {"type", "sequence_number", "code", "message", "param"}, payload
            return
        assert events and events[-1] == "[DONE]", text
        for event in events[:-1]:
            payload = json.loads(event)
            if "error" in payload:
                assert_envelope(payload)


def valid_for_this_server(case: Case, fit: bool, stream: bool, response_ids: list[str]) -> Case:
    """A valid request made to generate little: MAX_N choices of MAX_NEW_TOKENS at most. With `fit`, also made
    to pass the rules the document cannot state (the served model's id, token ids within its vocabulary, logit_bias
    keys that are ids, no tools, top_logprobs with logprobs, a stored response's id, a conversation that ends with
    the user), so that most of them reach the model, and streamed when `stream` (generated bodies rarely set it).
    Still valid."""
    body, path = case.body, case.operation.path
    if fit and "model_id" in (case.path_parameters or {}):
        case.path_parameters["model_id"] = MODEL
    if fit and "response_id" in (case.path_parameters or {}):
        case.path_parameters["response_id"] = response_ids[len(case.path_parameters["response_id"]) % 3]
    if not isinstance(body, dict):
        return case
    if fit:
        if "model" in body:
            body["model"] = MODEL
        for name in ("prompt", "tokens", "input"):
            if name in body:
                body[name] = in_vocabulary(body[name])
        if isinstance(body.get("logit_bias"), dict):
            body["logit_bias"] = {str(i * 997 % VOCAB): v for i, v in enumerate(body["logit_bias"].values())}
        body.pop("tools", None)
        if body.get("top_logprobs") is not None and path == "/v1/chat/completions":
            body["logprobs"] = True
        if path in NAMED_STREAMS or path == "/v1/messages/count_tokens":
            for name in ("tool_choice", "text"):
                body.pop(name, None)
            if "previous_response_id" in body:
                body["previous_response_id"] = response_ids[0]
            if path != "/v1/responses" and body.get("messages"):
                body["messages"][-1]["role"] = "user"
        if stream and (path in GENERATION_PATHS or path in NAMED_STREAMS):
            body["stream"] = True
    if path == "/v1/responses":
        body["max_output_tokens"] = min(body.get("max_output_tokens") or MAX_NEW_TOKENS, MAX_NEW_TOKENS)
    if path == "/v1/messages":
        body["max_tokens"] = min(body["max_tokens"], MAX_NEW_TOKENS)
    if path in GENERATION_PATHS:
        body["n"] = min(body.get("n", 1), MAX_N)
        budget = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        asked = body.get(budget)  # None: the rest of the context
        for name in ("max_tokens", "max_completion_tokens"):
            if body.get(name) is not None:
                body[name] = min(body[name], MAX_NEW_TOKENS)
        if asked is None:
            body[budget] = MAX_NEW_TOKENS
        if asked is None or body.get("min_tokens", 0) <= asked:  # keep min_tokens <= the budget if it was
            body["min_tokens"] = min(body.get("min_tokens", 0), body[budget])
    return case


def in_vocabulary(value: Any) -> Any:
    """Token ids (in lists, or lists of lists) taken modulo the vocabulary size; anything else as it is."""
    if isinstance(value, list):
        return [in_vocabulary(v) for v in value]
    return value % VOCAB if isinstance(value, int) and not isinstance(value, bool) else value


def test_the_document_has_every_route(api: schemathesis.BaseSchema) -> None:
    labels = {result.ok().label for result in api.get_all_operations()}
    assert labels == set(EXAMPLES)


# Valid requests for every route; invalid ones (a broken body, a missing or wrong key) where there is one to break.
RUNS = [(label, GenerationMode.POSITIVE) for label in EXAMPLES] + \
    [(label, GenerationMode.NEGATIVE) for label in EXAMPLES if label not in PROBES]


@pytest.mark.parametrize("label,mode", RUNS, ids=[f"{label}-{mode}" for label, mode in RUNS])
def test_route_answers_as_documented(api: schemathesis.BaseSchema, session: requests.Session,
                                     summary: dict[str, Counter], response_ids: list[str], label: str,
                                     mode: GenerationMode) -> None:
    operation = api.find_operation_by_label(label)
    assert operation is not None, label
    strategy = operation.as_strategy(generation_mode=mode)
    if mode is GenerationMode.POSITIVE:  # 3 in 4 fit the server, half of those streamed; the others mostly 404/400
        strategy = st.tuples(strategy, st.integers(0, 7)).map(
            lambda drawn: valid_for_this_server(drawn[0], fit=drawn[1] > 1, stream=drawn[1] > 4,
                                                response_ids=response_ids))

    # No shrinking: each step is a request, and schemathesis already reports the failing one as a curl command.
    @settings(max_examples=EXAMPLES[label], deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def run(case: Case) -> None:
        response = case.call(session=session, timeout=60)
        streamed = response.headers.get("content-type", [""])[0].startswith("text/event-stream")
        summary[label][f"{response.status_code}{' SSE' if streamed else ''}"] += 1
        case.validate_response(response, checks=CHECKS)
        assert_errors_are_envelopes(response, case.operation.path)

    run()
