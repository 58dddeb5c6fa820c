"""POST /v1/embeddings on real servers through the official openai client: all-MiniLM-L6-v2 served on its own, and
SmolLM2 started with --embeddings (the suite's server, last-token pooling; and one with mean pooling), each against
the engine in this process. (A decoder without --embeddings refusing:
tests/server/api/openai/test_serving_embeddings.py.)"""
from __future__ import annotations

import base64
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F

from engine import load_runner
from tests.support.server_process import EXACT, ServerProcess, start_server, stop_server

MINILM = "all-minilm-l6-v2"
SMOLLM = "smollm2-135m"
TEXTS = ["The cat sat on the mat.", "Embeddings place similar meanings close together.", "ok",
         "Le café est délicieux — 東京 🙂"]


def _client(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def minilm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = start_server(tmp_path_factory.mktemp("minilm"), "--model", MINILM)
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def minilm_client(minilm_server: ServerProcess) -> openai.OpenAI:
    return _client(minilm_server)


@pytest.fixture(scope="module")
def minilm():
    return load_runner(MINILM)


def _vectors(response) -> np.ndarray:
    assert [d.index for d in response.data] == list(range(len(response.data)))
    assert all(d.object == "embedding" for d in response.data) and response.object == "list"
    return np.array([d.embedding for d in response.data], dtype=np.float64)


def test_strings_lists_and_token_ids(minilm_client: openai.OpenAI, minilm) -> None:
    ids = [minilm.tokenizer.encode(t) for t in TEXTS]
    expected = minilm.embed(ids).double().numpy()
    listed = minilm_client.embeddings.create(model=MINILM, input=TEXTS, encoding_format="float")
    assert listed.model == MINILM
    np.testing.assert_allclose(_vectors(listed), expected, rtol=0, atol=1e-6)
    assert listed.usage.prompt_tokens == listed.usage.total_tokens == sum(map(len, ids))
    single = minilm_client.embeddings.create(model=MINILM, input=TEXTS[1], encoding_format="float")
    np.testing.assert_allclose(_vectors(single)[0], expected[1], rtol=0, atol=1e-6)
    assert single.usage.prompt_tokens == len(ids[1])
    as_ids = minilm_client.embeddings.create(model=MINILM, input=ids, encoding_format="float")
    np.testing.assert_allclose(_vectors(as_ids), expected, rtol=0, atol=1e-6)
    one_id_list = minilm_client.embeddings.create(model=MINILM, input=ids[0], encoding_format="float")
    np.testing.assert_allclose(_vectors(one_id_list)[0], expected[0], rtol=0, atol=1e-6)
    assert np.allclose(np.linalg.norm(_vectors(listed), axis=1), 1.0, atol=1e-6)


def test_base64_is_the_float32_values(minilm_server: ServerProcess, minilm_client: openai.OpenAI) -> None:
    floats = _vectors(minilm_client.embeddings.create(model=MINILM, input=TEXTS, encoding_format="float"))
    # the client asks for base64 unless told otherwise, and decodes it itself
    by_default = _vectors(minilm_client.embeddings.create(model=MINILM, input=TEXTS))
    raw = httpx.post(f"{minilm_server.base_url}/v1/embeddings", timeout=60,
                     json={"model": MINILM, "input": TEXTS, "encoding_format": "base64"}).json()
    decoded = np.array([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in raw["data"]])
    assert decoded.shape == (len(TEXTS), 384)
    np.testing.assert_array_equal(decoded, floats.astype(np.float32))
    np.testing.assert_array_equal(by_default, floats)


def test_dimensions_truncate_and_renormalise(minilm_client: openai.OpenAI) -> None:
    full = _vectors(minilm_client.embeddings.create(model=MINILM, input=TEXTS, encoding_format="float"))
    for dims in (1, 16, 384):
        cut = _vectors(minilm_client.embeddings.create(model=MINILM, input=TEXTS, dimensions=dims,
                                                       encoding_format="float"))
        expected = full[:, :dims] / np.linalg.norm(full[:, :dims], axis=1, keepdims=True)
        assert cut.shape == (len(TEXTS), dims)
        np.testing.assert_allclose(cut, expected, rtol=0, atol=1e-6)


def test_concurrent_requests_each_get_their_own_vectors(minilm_client: openai.OpenAI, minilm) -> None:
    texts = [f"request {i}: " + " ".join(TEXTS[: 1 + i % 4]) for i in range(12)]
    expected = minilm.embed([minilm.tokenizer.encode(t) for t in texts]).double().numpy()
    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(lambda t: _vectors(minilm_client.embeddings.create(
            model=MINILM, input=[t, "ok"], encoding_format="float"))[0], texts))
    np.testing.assert_allclose(np.array(got), expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("body, param, message", [
    ({"input": ""}, "input", "input[0] is an empty string"),
    ({"input": []}, "input", "input must not be empty"),
    ({"input": ["fine", ""]}, "input", "input[1] is an empty string"),
    ({"input": [[101, 102], []]}, "input", "input[1] is an empty list of token ids"),
    ({"input": ["x"] * 2049}, "input", "at most 2048"),
    ({"input": ["short", "word " * 600]}, "input", "input[1] has 602 tokens; this model takes at most 512"),
    ({"input": [101, 30522]}, "input", "outside the vocabulary"),
    ({"input": "hi", "dimensions": 0}, "dimensions", "greater than or equal to 1"),
    ({"input": "hi", "dimensions": 385}, "dimensions", "at most 384"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format", "'float' or 'base64'"),
    ({"input": 5}, "input", None),
])
def test_bad_input_gets_the_error_envelope(minilm_client: openai.OpenAI, body: dict, param: str,
                                           message: str | None) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        minilm_client.embeddings.create(model=MINILM, **body)
    error = e.value.body
    assert e.value.status_code == 400 and error["type"] == "invalid_request_error" and error["param"] == param
    assert message is None or message in error["message"], error["message"]


def test_an_embedding_model_answers_no_generation(minilm_client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        minilm_client.embeddings.create(model="text-embedding-3-small", input="hi")
    messages = [{"role": "user", "content": "hi"}]
    for call in (lambda: minilm_client.chat.completions.create(model=MINILM, messages=messages),
                 lambda: minilm_client.completions.create(model=MINILM, prompt="hi")):
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert e.value.body["param"] == "model" and e.value.body["code"] == "embeddings_only"
        assert "this model serves embeddings only" in e.value.body["message"]


# ---- a decoder with --embeddings ----

def test_a_text_the_tokenizer_keeps_nothing_of_gets_a_400(server, smollm) -> None:
    """SmolLM2's tokenizer drops a lone control character and adds no BOS: such an input has no tokens to pool
    (found by the OpenAPI fuzz test: it was a 500 from the worker's step)."""
    assert smollm.tokenizer.encode("\x13") == []
    with pytest.raises(openai.BadRequestError) as e:
        _client(server).embeddings.create(model=SMOLLM, input=["fine", "\x13"])
    assert e.value.body["param"] == "input" and "input[1] has no tokens" in e.value.body["message"]
    assert _client(server).embeddings.create(model=SMOLLM, input=["fine"]).data  # and the worker goes on


def _engine_reference(runner, text: str, pooling: str) -> np.ndarray:
    """What the server should answer, from the engine's final-norm hidden states over the whole prompt (the input of
    the LM head when every position's logits are asked for)."""
    captured = []
    handle = runner.model.lm_head.register_forward_hook(lambda module, args, out: captured.append(args[0]))
    try:
        runner.predict_logits(runner.tokenizer.encode(text))
    finally:
        handle.remove()
    states = captured[0].double()
    vec = states[-1] if pooling == "last" else states.mean(0)
    return F.normalize(vec, dim=0).numpy()


@pytest.fixture(scope="module", params=["last", "mean"])
def decoder_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    if request.param == "last":  # the default pooling, on the suite's server
        yield request.getfixturevalue("server"), "last"
        return
    srv = start_server(tmp_path_factory.mktemp("embed-mean"), "--model", SMOLLM, *EXACT, "--embeddings",
                       "--pooling", "mean")
    yield srv, "mean"
    stop_server(srv)


def test_decoder_embeddings_pool_the_engine_hidden_states(decoder_server, smollm) -> None:
    srv, pooling = decoder_server
    client = _client(srv)
    got = _vectors(client.embeddings.create(model=SMOLLM, input=TEXTS, encoding_format="float"))
    assert got.shape == (len(TEXTS), 576)
    expected = np.array([_engine_reference(smollm, t, pooling) for t in TEXTS])
    np.testing.assert_allclose(got, expected, rtol=0, atol=2e-5)
    # the same server still generates
    reply = client.completions.create(model=SMOLLM, prompt="The capital of France is", max_tokens=4, temperature=0)
    assert reply.choices[0].finish_reason == "length"

