"""Speculative decoding on a real server: `--speculative ngram` answers exactly what the engine decodes without it
(greedy, concurrent requests, a stop string), and reports its acceptance in /health and /metrics. The same server
streams with `--stream-interval 4`: fewer chunks, the same text."""
from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.support.greedy_reference import Reference
from tests.support.server_process import EXACT, ServerProcess, start_server, stop_server

MODEL = "smollm2-135m"
CODE = '''def total(items):
    result = 0
    for item in items:
        result += item.price * item.quantity
    return result


def cheapest(items):
    return min(items, key=lambda item: item.price)
'''
COPY = [{"role": "user", "content": f"Repeat this code exactly, with `total` renamed to `order_total`:\n\n{CODE}"}]
FREE = [{"role": "user", "content": "Write two sentences about the sea."}]


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = start_server(tmp_path_factory.mktemp("spec"), "--model", MODEL, *EXACT, "--speculative", "ngram",
                       "--num-speculative-tokens", "4", "--stream-interval", "4")
    yield srv
    stop_server(srv)


def test_greedy_outputs_equal_the_engine_without_speculation(spec_server: ServerProcess, ref: Reference) -> None:
    expected = {name: ref.generate(ref.chat_ids(messages), 32) for name, messages in (("copy", COPY), ("free", FREE))}
    text = ref.text(expected["copy"])
    stop = text[len(text) // 2:len(text) // 2 + 4]

    async def main() -> list:
        client = openai.AsyncOpenAI(base_url=f"{spec_server.base_url}/v1", api_key="unused", max_retries=0,
                                    timeout=120)

        async def ask(messages: list[dict], **kw) -> openai.types.chat.ChatCompletion:
            return await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32,
                                                        temperature=0, **kw)

        async with client:
            return await asyncio.gather(ask(COPY), ask(FREE), ask(COPY, logprobs=True), ask(COPY, stop=[stop]))

    copy, free, logged, stopped = asyncio.run(main())
    assert copy.choices[0].message.content == ref.text(expected["copy"])
    assert free.choices[0].message.content == ref.text(expected["free"])
    assert logged.choices[0].message.content == ref.text(expected["copy"])
    target = ref.logprobs(ref.chat_ids(COPY), expected["copy"])
    got = [t.logprob for t in logged.choices[0].logprobs.content]
    assert got == pytest.approx([float(target[i, t]) for i, t in enumerate(expected["copy"])], abs=1e-4)
    # A stop string in the middle of the copied text cuts there.
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == text[:text.index(stop)]

    health = httpx.get(f"{spec_server.base_url}/health").json()
    assert health["speculative"] == "ngram"
    assert health["spec_decode_num_drafts"] > 0
    assert 0 < health["spec_decode_num_accepted_tokens"] <= health["spec_decode_num_draft_tokens"]
    assert health["spec_decode_acceptance_rate"] == pytest.approx(
        health["spec_decode_num_accepted_tokens"] / health["spec_decode_num_draft_tokens"])
    metrics = httpx.get(f"{spec_server.base_url}/metrics").text
    accepted = next(line for line in metrics.splitlines()
                    if line.startswith("emberserve:spec_decode_num_accepted_tokens_total"))
    assert float(accepted.split()[-1]) == health["spec_decode_num_accepted_tokens"]
    assert 'emberserve:spec_decode_num_accepted_tokens_per_pos_total{position="0"}' in metrics


def test_a_stream_interval_sends_the_same_text_in_fewer_chunks(spec_server: ServerProcess, ref: Reference) -> None:
    expected = ref.generate(ref.chat_ids(FREE), 32)
    client = openai.OpenAI(base_url=f"{spec_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    chunks = list(client.chat.completions.create(model=MODEL, messages=FREE, max_tokens=32, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    content = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(content) == ref.text(expected)
    assert chunks[-1].usage.completion_tokens == len(expected)
    # the first token alone, then (accepted drafts or not) at least four tokens a chunk, the rest with the finish
    assert 3 <= len(content) <= 2 + (len(expected) - 1) // 4, [len(c) for c in content]
