"""A mixture-of-experts model on a real server (tiny random Qwen3-MoE, tests/support/tiny_models.py, CPU float32):
greedy answers equal the engine's own greedy decoding, a repeated prompt is read from the prefix cache, n-gram and
draft-model speculation answer what the model decodes without them, structured outputs validate against their
schema, and deterministic mode gives a request the same tokens and logprobs alone and beside others."""
from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from engine import load_runner
from tests.support.greedy_reference import Reference
from tests.support.server_process import EXACT, ServerProcess, start_server, stop_server
from tests.support.tiny_models import build_tiny_model

SERVED = "tiny-moe"
LONG_SYSTEM = ("You answer questions about the sea. The quick brown fox jumps over the lazy dog. Peter Piper picked "
               "a peck of pickled peppers; she sells sea shells by the sea shore. Numbers like 12, 345 and 6789.")
QUESTIONS = ["Hello there, how are you today?", "The quick brown fox jumps over the lazy dog.",
             "Numbers like 12 and 345 are split into pieces."]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("moe-models")
    # the dense qwen3 tiny model shares the tokenizer (same corpus, same special tokens): a draft model for it
    return {v: str(build_tiny_model(v, root).safetensors_dir) for v in ("qwen3_moe", "qwen3")}


@pytest.fixture(scope="module")
def ref(model_dirs: dict[str, str]) -> Reference:
    return Reference(load_runner(model_dirs["qwen3_moe"], dtype="float32"))


@pytest.fixture(scope="module")
def ngram_server(tmp_path_factory: pytest.TempPathFactory, model_dirs: dict[str, str]) -> Iterator[ServerProcess]:
    srv = start_server(tmp_path_factory.mktemp("moe-ngram"), "--model", model_dirs["qwen3_moe"], "--served-model-name",
                       SERVED, "--device", "cpu", *EXACT, "--speculative", "ngram")
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def draft_server(tmp_path_factory: pytest.TempPathFactory, model_dirs: dict[str, str]) -> Iterator[ServerProcess]:
    srv = start_server(tmp_path_factory.mktemp("moe-draft"), "--model", model_dirs["qwen3_moe"], "--served-model-name",
                       SERVED, "--device", "cpu", *EXACT, "--draft-model", model_dirs["qwen3"], "--deterministic")
    yield srv
    stop_server(srv)


def _client(server: ServerProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def _messages(question: str, system: str | None = None) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]


@pytest.mark.parametrize("which", ["ngram_server", "draft_server"])
def test_concurrent_greedy_streams_equal_the_engine(request: pytest.FixtureRequest, which: str, ref: Reference) -> None:
    server = request.getfixturevalue(which)

    async def main() -> list[str]:
        async with _client(server) as client:
            async def stream(question: str) -> str:
                chunks = await client.chat.completions.create(model=SERVED, messages=_messages(question), stream=True,
                                                              temperature=0, max_tokens=24)
                return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
            return await asyncio.gather(*(stream(q) for q in QUESTIONS))

    texts = asyncio.run(main())
    for question, text in zip(QUESTIONS, texts):
        assert text == ref.text(ref.generate(ref.chat_ids(_messages(question)), 24)), question
    health = httpx.get(f"{server.base_url}/health").json()
    assert health["speculative"] == ("ngram" if which == "ngram_server" else "draft")
    assert health["spec_decode_num_draft_tokens"] > 0  # the drafts were verified by the MoE model


def test_a_repeated_prompt_is_read_from_the_prefix_cache(ngram_server: ServerProcess, ref: Reference) -> None:
    messages = _messages("Hello there, how are you today?", LONG_SYSTEM)

    async def ask() -> openai.types.chat.ChatCompletion:
        async with _client(ngram_server) as client:
            return await client.chat.completions.create(model=SERVED, messages=messages, temperature=0, max_tokens=12)

    first, second = asyncio.run(ask()), asyncio.run(ask())
    prompt_tokens = len(ref.chat_ids(messages))
    assert first.usage.prompt_tokens == second.usage.prompt_tokens == prompt_tokens
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 16 * ((prompt_tokens - 1) // 16) > 0  # every full block of the prompt
    assert first.choices[0].message.content == second.choices[0].message.content
    assert second.choices[0].message.content == ref.text(ref.generate(ref.chat_ids(messages), 12))


def test_structured_output_validates(ngram_server: ServerProcess) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "count": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "count"], "additionalProperties": False}

    async def ask() -> openai.types.chat.ChatCompletion:
        async with _client(ngram_server) as client:
            return await client.chat.completions.create(
                model=SERVED, messages=_messages("Name a thing and count it."), max_tokens=60, temperature=0,
                response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": schema,
                                                                        "strict": True}})

    reply = asyncio.run(ask())
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)


def test_deterministic_mode_gives_a_request_the_same_logprobs_alone_and_batched(draft_server: ServerProcess) -> None:
    async def main() -> tuple[list, list]:
        async with _client(draft_server) as client:
            async def ask(question: str, max_tokens: int = 16) -> openai.types.chat.ChatCompletion:
                return await client.chat.completions.create(model=SERVED, messages=_messages(question),
                                                            temperature=0, max_tokens=max_tokens, logprobs=True)
            alone = await ask(QUESTIONS[0])
            batched = await asyncio.gather(ask(QUESTIONS[0]), *(ask(q, 40) for q in QUESTIONS[1:]))
            return alone, batched[0]

    alone, batched = asyncio.run(main())
    assert alone.choices[0].message.content == batched.choices[0].message.content
    assert [t.logprob for t in alone.choices[0].logprobs.content] == \
        [t.logprob for t in batched.choices[0].logprobs.content]


def test_models_lists_the_experts(ngram_server: ServerProcess, model_dirs: dict[str, str]) -> None:
    from safetensors import safe_open

    card = httpx.get(f"{ngram_server.base_url}/v1/models").json()["data"][0]
    config = json.loads((Path(model_dirs["qwen3_moe"]) / "config.json").read_text())
    with safe_open(str(Path(model_dirs["qwen3_moe"]) / "model.safetensors"), "pt") as f:
        parameters = sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    details = card["details"]
    assert details["family"] == "qwen3_moe"
    # transformers writes Qwen3-MoE's num_experts as num_local_experts; the hub's checkpoints say num_experts
    experts = config.get("num_experts") or config["num_local_experts"]
    assert (details["expert_count"], details["expert_used_count"]) == (experts, config["num_experts_per_tok"])
    assert details["parameters"] == parameters
