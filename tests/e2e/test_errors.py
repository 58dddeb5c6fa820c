"""Every failure answers the OpenAI envelope `{"error": {"message", "type", "param", "code"}}` with the right
status, seen both on the wire (raw httpx) and through the official client's exception classes; the server keeps
serving afterwards. Failures after a stream started are covered in-process in tests/server/api/test_serving_errors.py.
"""
from __future__ import annotations

import json
import time
from typing import Any

import httpx
import openai
import pytest

MODEL = "smollm2-135m"  # the model the session `server` fixture serves

VOCAB = 49152
CONTEXT = 8192
MSGS = [{"role": "user", "content": "Hi"}]
CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": MSGS, "max_tokens": 4, **fields}


def cmpl(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Hi", "max_tokens": 4, **fields}


def assert_envelope(r: httpx.Response, status: int, param: str | None | type(...) = ...,
                    code: str | None | type(...) = ..., type_: str | None = None) -> dict[str, Any]:
    """The response is exactly the OpenAI error envelope with `status`; returns the inner error object."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json"), r.headers
    assert "Traceback" not in r.text and 'File "' not in r.text, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"].strip(), error
    assert isinstance(error["type"], str) and error["type"], error
    assert error["code"] is None or isinstance(error["code"], str), error
    assert error["param"] is None or isinstance(error["param"], str), error
    if param is not ...:
        assert error["param"] == param, error
    if code is not ...:
        assert error["code"] == code, error
    if type_ is not None:
        assert error["type"] == type_, error
    return error


# (path, body, param, words the message must contain)
BAD_REQUESTS = {
    "negative max_tokens": (CHAT, chat(max_tokens=-1), "max_tokens", ["max_tokens"]),
    "negative max_tokens (completions)": (CMPL, cmpl(max_tokens=-5), "max_tokens", ["max_tokens"]),
    "temperature 2.5": (CHAT, chat(temperature=2.5), "temperature", ["temperature"]),
    "top_p 0": (CHAT, chat(top_p=0), "top_p", ["top_p"]),
    "top_p 1.5": (CMPL, cmpl(top_p=1.5), "top_p", ["top_p"]),
    "n 0": (CHAT, chat(n=0), "n", []),
    "logit_bias id >= vocab": (CHAT, chat(logit_bias={str(VOCAB): 5}), "logit_bias", [str(VOCAB)]),
    "logit_bias negative id": (CMPL, cmpl(logit_bias={"-1": 5}), "logit_bias", ["-1"]),
    "logit_bias non-numeric key": (CHAT, chat(logit_bias={"hello": 5}), "logit_bias", ["hello"]),
    "top_logprobs 21": (CHAT, chat(logprobs=True, top_logprobs=21), "top_logprobs", ["20"]),
    "top_logprobs without logprobs": (CHAT, chat(top_logprobs=2), "top_logprobs", ["logprobs"]),
    "completions logprobs 21": (CMPL, cmpl(logprobs=21), "logprobs", ["20"]),
    "5 stop strings": (CHAT, chat(stop=["a", "b", "c", "d", "e"]), "stop", ["4"]),
    "messages a string": (CHAT, chat(messages="hi"), "messages", ["messages"]),
    "max_tokens a string": (CHAT, chat(max_tokens="ten"), "max_tokens", ["max_tokens"]),
    # JSON types as the schema states them: no coercion of "5" or true to an integer, or of 1 to a boolean
    "max_tokens a numeric string": (CHAT, chat(max_tokens="5"), "max_tokens", ["max_tokens"]),
    "echo a number": (CMPL, cmpl(echo=1), "echo", ["echo"]),
    "temperature a boolean": (CMPL, cmpl(temperature=True), "temperature", ["temperature"]),
    "prompt a number": (CMPL, cmpl(prompt=5), "prompt", ["prompt"]),
    "empty messages": (CHAT, chat(messages=[]), "messages", ["messages"]),
    "message without role": (CHAT, chat(messages=[{"content": "hi"}]), "messages.0.role", ["role"]),
    "image_url content part": (CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]),
        "messages.0.content", ["image_url"]),
    "min_tokens > max_tokens": (CHAT, chat(max_tokens=2, min_tokens=5), "min_tokens", ["5", "2"]),
    "min_tokens > max_tokens (completions)": (CMPL, cmpl(max_tokens=3, min_tokens=4), "min_tokens", ["4", "3"]),
    "token id = vocab": (CMPL, cmpl(prompt=[1, 2, VOCAB]), "prompt", [str(VOCAB)]),
    "negative token id": (CMPL, cmpl(prompt=[[1, 2], [3, -7]]), "prompt", ["-7"]),
    "detokenize id out of range": ("/detokenize", {"tokens": [1, VOCAB + 10]}, "tokens", [str(VOCAB + 10)]),
    "detokenize negative id": ("/detokenize", {"tokens": [-3]}, "tokens", ["-3"]),
    "detokenize non-integer": ("/detokenize", {"tokens": ["a"]}, "tokens.0", []),
    "detokenize a boolean id": ("/detokenize", {"tokens": [1, True]}, "tokens.1", []),
    "tokenize neither prompt nor messages": ("/tokenize", {}, "prompt", []),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_is_a_400_envelope(http: httpx.Client, case: str) -> None:
    path, body, param, words = BAD_REQUESTS[case]
    error = assert_envelope(http.post(path, json=body), 400, param=param, type_="invalid_request_error")
    for word in words:
        assert word in error["message"], error


@pytest.mark.parametrize("case", [c for c, v in BAD_REQUESTS.items() if v[0] in (CHAT, CMPL)])
def test_bad_request_streaming_is_a_400_before_the_stream(http: httpx.Client, case: str) -> None:
    """Validation happens before any event is sent: a JSON 400, not a 200 event stream."""
    path, body, param, _ = BAD_REQUESTS[case]
    assert_envelope(http.post(path, json={**body, "stream": True}), 400, param=param)


# The same failures through the official client: (method, kwargs, param).
CLIENT_CASES = {
    "negative max_tokens": ("chat", dict(max_tokens=-1), "max_tokens"),
    "temperature 2.5": ("chat", dict(temperature=2.5), "temperature"),
    "top_p 0": ("chat", dict(top_p=0), "top_p"),
    "top_p 1.5": ("completions", dict(top_p=1.5), "top_p"),
    "n 0": ("chat", dict(n=0), "n"),
    "logit_bias id >= vocab": ("chat", dict(logit_bias={str(VOCAB): 1}), "logit_bias"),
    "logit_bias non-numeric key": ("chat", dict(logit_bias={"x": 1}), "logit_bias"),
    "top_logprobs 21": ("chat", dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    "top_logprobs without logprobs": ("chat", dict(top_logprobs=3), "top_logprobs"),
    "5 stop strings": ("chat", dict(stop=["1", "2", "3", "4", "5"]), "stop"),
    "streaming, top_p 0": ("chat", dict(top_p=0, stream=True), "top_p"),
    "empty messages": ("chat", dict(messages=[]), "messages"),
    "image_url content part": ("chat", dict(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]), "messages.0.content"),
    "min_tokens > max_tokens": ("chat", dict(max_tokens=1, extra_body={"min_tokens": 3}), "min_tokens"),
    "token id out of range": ("completions", dict(prompt=[5, VOCAB]), "prompt"),
}


def call(client: openai.OpenAI, method: str, kwargs: dict[str, Any]) -> Any:
    if method == "chat":
        return client.chat.completions.create(**{"model": MODEL, "messages": MSGS, "max_tokens": 4, **kwargs})
    return client.completions.create(**{"model": MODEL, "prompt": "Hi", "max_tokens": 4, **kwargs})


@pytest.mark.parametrize("case", list(CLIENT_CASES))
def test_bad_request_raises_bad_request_error(client: openai.OpenAI, case: str) -> None:
    method, kwargs, param = CLIENT_CASES[case]
    with pytest.raises(openai.BadRequestError) as e:
        call(client, method, kwargs)
    err = e.value
    assert err.status_code == 400
    assert isinstance(err.body, dict) and set(err.body) == {"message", "type", "param", "code"}, err.body
    assert err.param == param and err.body["param"] == param
    assert err.type == "invalid_request_error"
    assert err.body["message"] in err.message  # our message is what the client shows
    assert "Traceback" not in err.message


def test_context_overflow_states_the_numbers(http: httpx.Client) -> None:
    prompt = [1000 + i for i in range(100)]
    error = assert_envelope(http.post(CMPL, json=cmpl(prompt=prompt, max_tokens=CONTEXT - 50)), 400,
                            param="max_tokens", code="context_length_exceeded")
    for number in (CONTEXT, 100, CONTEXT - 50, CONTEXT + 50):
        assert str(number) in error["message"], error


def test_context_exactly_full_is_accepted(http: httpx.Client) -> None:
    """prompt + max_tokens == context is allowed (checked by streaming the first event, then leaving)."""
    prompt = [1000 + i for i in range(100)]
    with http.stream("POST", CMPL, json=cmpl(prompt=prompt, max_tokens=CONTEXT - 100, stream=True)) as r:
        assert r.status_code == 200
        first = next(line for line in r.iter_lines() if line.startswith("data:"))
        assert '"error"' not in first


def test_chat_context_overflow_states_the_numbers(client: openai.OpenAI, http: httpx.Client) -> None:
    prompt_tokens = http.post("/tokenize", json={"model": MODEL, "messages": MSGS}).json()["count"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=CONTEXT)
    assert e.value.code == "context_length_exceeded" and e.value.param == "max_tokens"
    for number in (CONTEXT, prompt_tokens, prompt_tokens + CONTEXT):
        assert str(number) in e.value.body["message"], e.value.body
    with pytest.raises(openai.BadRequestError) as e:  # max_completion_tokens is checked the same way
        client.chat.completions.create(model=MODEL, messages=MSGS, max_completion_tokens=CONTEXT)
    assert e.value.code == "context_length_exceeded"


HUGE = "The quick brown fox jumps over the lazy dog. " * 6700  # ~300k characters, ~60k tokens


@pytest.mark.parametrize("path,body", [
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": HUGE}]}),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": HUGE}], "max_tokens": 5, "stream": True}),
    (CMPL, {"model": MODEL, "prompt": HUGE, "max_tokens": 5}),
], ids=["chat", "chat-stream", "completions"])
def test_huge_input_is_a_quick_400(http: httpx.Client, path: str, body: dict) -> None:
    assert len(HUGE) >= 300_000
    started = time.monotonic()
    r = http.post(path, json=body)
    elapsed = time.monotonic() - started
    error = assert_envelope(r, 400, code="context_length_exceeded")
    assert str(CONTEXT) in error["message"], error
    assert elapsed < 10, f"a too-long prompt took {elapsed:.1f}s to reject"
    assert http.get("/health").json()["status"] == "ok"
    assert http.post(CMPL, json=cmpl(max_tokens=2)).status_code == 200


def test_huge_input_raises_bad_request_error(client: openai.OpenAI) -> None:
    started = time.monotonic()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=HUGE, max_tokens=5)
    assert time.monotonic() - started < 10
    assert e.value.code == "context_length_exceeded" and str(CONTEXT) in e.value.message


@pytest.mark.parametrize("path,body", [(CHAT, chat(model="no-such-model")), (CMPL, cmpl(model="no-such-model")),
                                       ("/tokenize", {"model": "no-such-model", "prompt": "hi"})],
                         ids=["chat", "completions", "tokenize"])
def test_unknown_model_is_a_404_model_not_found(http: httpx.Client, path: str, body: dict) -> None:
    error = assert_envelope(http.post(path, json=body), 404, param="model", code="model_not_found")
    assert "no-such-model" in error["message"]


def test_unknown_model_raises_not_found_error(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-model", messages=MSGS, max_tokens=2)
    assert e.value.code == "model_not_found" and "no-such-model" in e.value.message
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-model", messages=MSGS, max_tokens=2, stream=True)
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.code == "model_not_found" and e.value.body["param"] == "model"


@pytest.mark.parametrize("method,path", [("GET", "/v1/nope"), ("POST", "/nope"), ("POST", "/v1/chat/complete"),
                                         ("GET", "/v1")])  # "/" is the chat page
def test_unknown_route_is_a_404_envelope(http: httpx.Client, method: str, path: str) -> None:
    assert_envelope(http.request(method, path, json={}), 404, type_="not_found_error")


def test_unknown_route_raises_not_found_error(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.images.generate(model=MODEL, prompt="a cat")


@pytest.mark.parametrize("method,path", [("GET", CHAT), ("GET", CMPL), ("DELETE", "/v1/models"),
                                         ("POST", "/health")])
def test_wrong_method_is_a_405_envelope(http: httpx.Client, method: str, path: str) -> None:
    r = http.request(method, path)
    assert_envelope(r, 405)
    assert r.headers.get("allow"), r.headers


@pytest.mark.parametrize("raw", [b'{"model": "smollm2-135m", "messages": [', b"{bad json}", b"",
                                 b'{"model": "x",}'], ids=["truncated", "garbage", "empty", "trailing-comma"])
def test_malformed_json_is_a_400_envelope_mentioning_json(http: httpx.Client, raw: bytes) -> None:
    r = http.post(CHAT, content=raw, headers={"content-type": "application/json"})
    error = assert_envelope(r, 400, param=None, type_="invalid_request_error")
    assert "json" in error["message"].lower(), error


def test_body_that_is_not_a_json_object_is_a_400_envelope(http: httpx.Client) -> None:
    for r in (http.post(CHAT, json=[1, 2, 3]), http.post(CMPL, json="hello"),
              http.post(CHAT, content=b"model=x&messages=y",  # form fields, not JSON
                        headers={"content-type": "application/x-www-form-urlencoded"}),
              http.post(CHAT, content=b"{not json")):  # no content-type at all
        error = assert_envelope(r, 400, param=None)
        assert "json" in error["message"].lower(), error


FAST_S = 5  # "answers at once rather than working on it or hanging", with room for a busy machine
MAX_QUEUED = 256  # the session server's --max-queued (the default)


def post_timed(http: httpx.Client, path: str, **kwargs: Any) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    r = http.post(path, **kwargs)
    return r, time.monotonic() - started


@pytest.mark.parametrize("path", [CHAT, CMPL, "/tokenize"])
def test_invalid_utf8_body_is_a_quick_400_saying_so(http: httpx.Client, path: str) -> None:
    raw = b'{"model": "smollm2-135m", "prompt": "caf\xe9 \xff", "messages": [{"role": "user", "content": "hi"}]}'
    r, elapsed = post_timed(http, path, content=raw, headers={"content-type": "application/json"})
    error = assert_envelope(r, 400, param=None, type_="invalid_request_error")
    assert "UTF-8" in error["message"], error
    assert elapsed < FAST_S


@pytest.mark.parametrize("field", ["prompt", "user", "stop"])
def test_deeply_nested_json_is_a_quick_400_saying_so(http: httpx.Client, field: str) -> None:
    """100,000 nested arrays: the parser's recursion limit, not a RecursionError 500 or a long walk."""
    depth = 100_000
    prompt = "" if field == "prompt" else ', "prompt": "hi"'
    raw = f'{{"model": "{MODEL}", "max_tokens": 1{prompt}, "{field}": {"[" * depth}{"]" * depth}}}'
    r, elapsed = post_timed(http, CMPL, content=raw.encode(), headers={"content-type": "application/json"})
    error = assert_envelope(r, 400, param=None)
    assert "nest" in error["message"] and "1,000" in error["message"], error
    assert elapsed < FAST_S


def test_nesting_the_parser_takes_is_still_a_plain_validation_400(http: httpx.Client) -> None:
    raw = f'{{"model": "{MODEL}", "prompt": {"[" * 500}1{"]" * 500}, "max_tokens": 1}}'
    r, elapsed = post_timed(http, CMPL, content=raw.encode(), headers={"content-type": "application/json"})
    assert_envelope(r, 400, param="prompt")
    assert elapsed < FAST_S


@pytest.mark.parametrize("path,body,param", [
    (CMPL, cmpl(prompt="caf\ud800e"), "prompt"),
    (CMPL, cmpl(prompt=["ok", "\udfff"]), "prompt"),
    (CMPL, cmpl(model="\ud83d"), "model"),
    (CHAT, chat(messages=[{"role": "user", "content": "x\ud800"}]), "messages.0.content"),
    (CHAT, chat(messages=[{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]),
     "messages.0.content"),
    (CHAT, chat(stop=["\udc00"]), "stop"),
    ("/tokenize", {"prompt": "\ud800"}, "prompt"),
], ids=["prompt", "prompt-list", "model", "message", "text-part", "stop", "tokenize"])
def test_lone_surrogate_is_a_400_naming_the_field(http: httpx.Client, path: str, body: dict, param: str) -> None:
    """JSON escapes like \\ud800 that pair with nothing are no text: the tokenizer and the UTF-8 response body
    would fail on them (a 500 before)."""
    raw = json.dumps(body)  # ensure_ascii: the lone surrogate travels as its \u escape, as a client would send it
    error = assert_envelope(http.post(path, content=raw, headers={"content-type": "application/json"}), 400,
                            param=param)
    assert "surrogate" in error["message"], error


def test_a_paired_surrogate_escape_is_a_character(http: httpx.Client) -> None:
    raw = json.dumps({"prompt": "\U0001F600"})  # sent as the pair \ud83d\ude00
    assert "\\ud83d\\ude00" in raw
    r = http.post("/tokenize", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("prompts", [[f"prompt {i}" for i in range(10_000)], [[1, 2, 3]] * (MAX_QUEUED + 1)],
                         ids=["10k-strings", "max-queued+1-token-lists"])
def test_more_prompts_than_the_queue_holds_is_a_quick_400(http: httpx.Client, prompts: list) -> None:
    """Checked before tokenizing or queueing: not a slow 429 that retrying cannot cure."""
    r, elapsed = post_timed(http, CMPL, json=cmpl(prompt=prompts, max_tokens=1))
    error = assert_envelope(r, 400, param="prompt", code="too_many_prompts")
    assert str(len(prompts)) in error["message"] and str(MAX_QUEUED) in error["message"], error
    assert elapsed < FAST_S
    assert http.get("/health").json()["queued"] == 0


def test_server_still_serves_after_all_errors(client: openai.OpenAI, http: httpx.Client) -> None:
    health = http.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert health.json()["running"] == 0
    out = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=3, temperature=0)
    assert out.choices[0].finish_reason in ("length", "stop") and out.usage.completion_tokens >= 1
    stream = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, stream=True, temperature=0)
    assert "".join(c.choices[0].text for c in stream if c.choices)


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None,
                                          "text/plain; charset=utf-8"])
def test_a_json_body_is_read_as_json_whatever_its_content_type(http: httpx.Client, content_type: str | None) -> None:
    raw = json.dumps({"model": "smollm2-135m", "prompt": "Hello", "max_tokens": 2}).encode()
    headers = {} if content_type is None else {"content-type": content_type}
    r = http.post(CMPL, content=raw, headers=headers)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("content_type", ["application/json", "text/plain"])
def test_a_json_syntax_error_says_its_line_and_column(http: httpx.Client, content_type: str) -> None:
    raw = '{\n  "model": "smollm2-135m",\n  "messages": [{"role": "user" "content": "hi"}]\n}'
    with pytest.raises(json.JSONDecodeError) as expected:  # the reference: Python's own parser's position
        json.loads(raw)
    error = assert_envelope(http.post(CHAT, content=raw.encode(), headers={"content-type": content_type}), 400,
                            param=None)
    assert f"line {expected.value.lineno}, column {expected.value.colno}" in error["message"], error
