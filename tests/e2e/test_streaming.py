"""Streaming (server-sent events): what the openai client sees, the raw wire format, stop strings and UTF-8.

Each streamed result is compared with greedy decoding by the engine in the test process (same weights, fp32).
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence

import httpx
import openai
import pytest

from tests.support.greedy_reference import Reference, spanning_stop

MODEL = "smollm2-135m"
POEM = [{"role": "user", "content": "Write a short poem about the sea."}]
HI = [{"role": "user", "content": "Hi"}]
SHORT_ANSWER = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]
JAPANESE = [{"role": "user", "content": "Translate 'good morning' into Japanese and add a sun emoji"}]
CAPITAL = "The capital of France is"
EMOJI = "Emoji for sun: ☀️, emoji for moon:"


def check_chat_chunks(chunks: list, n: int = 1) -> list[str]:
    """The openai-client view of a chat stream, per choice: role first, then content, finish_reason only last."""
    texts = [""] * n
    seen_role, finished = [False] * n, [None] * n
    for c in chunks:
        assert c.object == "chat.completion.chunk" and c.model == MODEL
        assert c.id == chunks[0].id
        for ch in c.choices:
            i = ch.index
            assert finished[i] is None, f"choice {i} has a chunk after its finish_reason"
            if not seen_role[i]:
                assert ch.delta.role == "assistant"
                seen_role[i] = True
            else:
                assert ch.delta.role is None
            texts[i] += ch.delta.content or ""
            finished[i] = ch.finish_reason
    assert all(seen_role) and all(f in ("stop", "length") for f in finished)
    return texts


# ---- the openai client ----

def test_chat_stream_sync(client: openai.OpenAI, ref: Reference) -> None:
    tokens = ref.generate(ref.chat_ids(POEM), 8)
    chunks = list(client.chat.completions.create(model=MODEL, messages=POEM, max_tokens=8, temperature=0,
                                                 stream=True))
    assert len(chunks) >= 3
    assert check_chat_chunks(chunks) == [ref.text(tokens)]
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason(tokens)
    assert all(c.usage is None for c in chunks)


def test_chat_stream_async(aclient: openai.AsyncOpenAI, ref: Reference) -> None:
    tokens = ref.generate(ref.chat_ids(HI), 8)

    async def run() -> list:
        async with aclient:
            stream = await aclient.chat.completions.create(model=MODEL, messages=HI, max_tokens=8, temperature=0,
                                                           stream=True)
            return [c async for c in stream]

    chunks = asyncio.run(run())
    assert check_chat_chunks(chunks) == [ref.text(tokens)]
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason(tokens)


def test_completions_stream(client: openai.OpenAI, ref: Reference, tokenizer) -> None:
    tokens = ref.generate(tokenizer.encode(CAPITAL), 8)
    chunks = list(client.completions.create(model=MODEL, prompt=CAPITAL, max_tokens=8, temperature=0, stream=True))
    assert all(c.object == "text_completion" for c in chunks)
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert chunks[-1].choices[0].finish_reason == "length"
    streamed = "".join(c.choices[0].text for c in chunks)
    assert streamed == ref.text(tokens)
    whole = client.completions.create(model=MODEL, prompt=CAPITAL, max_tokens=8, temperature=0)
    assert streamed == whole.choices[0].text


def test_n2_stream(client: openai.OpenAI, ref: Reference) -> None:
    expected = ref.text(ref.generate(ref.chat_ids(SHORT_ANSWER), 6))
    chunks = list(client.chat.completions.create(model=MODEL, messages=SHORT_ANSWER, max_tokens=6, temperature=0,
                                                 n=2, stream=True))
    assert check_chat_chunks(chunks, n=2) == [expected, expected]
    for i in (0, 1):
        mine = [ch for c in chunks for ch in c.choices if ch.index == i]
        assert mine[0].delta.role == "assistant"
        assert [ch.finish_reason is not None for ch in mine].count(True) == 1 and mine[-1].finish_reason


def test_concurrent_async_streams(aclient: openai.AsyncOpenAI, ref: Reference) -> None:
    conversations = [POEM, HI, SHORT_ANSWER]
    expected = [ref.text(ref.generate(ref.chat_ids(m), 6)) for m in conversations]

    async def one(messages: list[dict]) -> str:
        stream = await aclient.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                                       stream=True)
        return check_chat_chunks([c async for c in stream])[0]

    async def run() -> list[str]:
        async with aclient:
            return list(await asyncio.gather(*(one(m) for m in conversations)))

    assert asyncio.run(run()) == expected


# ---- the wire format ----

def sse_events(http: httpx.Client, path: str, body: dict) -> list[str]:
    """The `data:` payloads of a streamed response, checking the framing of every event on the way."""
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].split(";")[0].strip() == "text/event-stream"
        raw = r.read().decode()
    assert raw.endswith("data: [DONE]\n\n"), raw[-200:]
    payloads = []
    for event in raw.split("\n\n")[:-1]:
        lines = [line for line in event.split("\n") if not line.startswith(":")]  # ':' lines are keep-alives
        if not lines:
            continue
        assert len(lines) == 1 and lines[0].startswith("data: "), f"bad event {event!r}"
        payloads.append(lines[0].removeprefix("data: "))
    assert payloads[-1] == "[DONE]" and "[DONE]" not in payloads[:-1]
    return payloads[:-1]


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": POEM}),
    ("/v1/completions", {"prompt": CAPITAL}),
], ids=["chat", "completions"])
def test_wire_format_usage(http: httpx.Client, tokenizer, path: str, body: dict) -> None:
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0, "stream": True, **body}
    prompt_tokens = (len(tokenizer.apply_chat_template(POEM, add_generation_prompt=True)) if "messages" in body
                     else len(tokenizer.encode(CAPITAL)))

    chunks = [json.loads(p) for p in sse_events(http, path, {**body, "stream_options": {"include_usage": True}})]
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["prompt_tokens"] == prompt_tokens
    assert chunks[-1]["usage"]["completion_tokens"] == 4
    assert chunks[-1]["usage"]["total_tokens"] == prompt_tokens + 4
    assert all(c["choices"] for c in chunks[:-1])

    chunks = [json.loads(p) for p in sse_events(http, path, body)]
    assert all("usage" not in c for c in chunks)  # OpenAI leaves the key out unless include_usage
    assert all(c["choices"] for c in chunks)
    assert len({c["id"] for c in chunks}) == 1


# ---- stop strings and UTF-8 ----

def test_stop_string_spanning_tokens_never_leaks_chat(client: openai.OpenAI, ref: Reference) -> None:
    tokens = ref.generate(ref.chat_ids(POEM), 14)
    text = ref.text(tokens)
    stop, _ = spanning_stop(ref.text, tokens, 3, spanned=2)
    chunks = list(client.chat.completions.create(model=MODEL, messages=POEM, max_tokens=14, temperature=0,
                                                 stop=[stop], stream=True))
    deltas = [ch.delta.content or "" for c in chunks for ch in c.choices]
    assert all(stop not in d for d in deltas)
    assert "".join(deltas) == text[:text.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_stop_string_spanning_tokens_never_leaks_completions(client: openai.OpenAI, ref: Reference,
                                                             tokenizer) -> None:
    tokens = ref.generate(tokenizer.encode(CAPITAL), 12)
    text = ref.text(tokens)
    stop, _ = spanning_stop(ref.text, tokens, 2, spanned=3)
    chunks = list(client.completions.create(model=MODEL, prompt=CAPITAL, max_tokens=12, temperature=0, stop=stop,
                                            stream=True))
    deltas = [c.choices[0].text for c in chunks]
    assert all(stop not in d for d in deltas)
    assert "".join(deltas) == text[:text.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def _splits_characters(ref: Reference, tokens: Sequence[int]) -> bool:
    """Whether some token's bytes are not whole UTF-8 characters (so the server must hold bytes back)."""
    for t in tokens:
        try:
            ref.tok.token_bytes(t).decode()
        except UnicodeDecodeError:
            return True
    return False


def test_no_broken_utf8_chat(client: openai.OpenAI, ref: Reference) -> None:
    tokens = ref.generate(ref.chat_ids(JAPANESE), 8)
    expected = ref.text(tokens)
    assert _splits_characters(ref, tokens) and "\ufffd" not in expected
    chunks = list(client.chat.completions.create(model=MODEL, messages=JAPANESE, max_tokens=8, temperature=0,
                                                 stream=True))
    deltas = [ch.delta.content or "" for c in chunks for ch in c.choices]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == expected


def test_no_broken_utf8_completions(client: openai.OpenAI, ref: Reference, tokenizer) -> None:
    tokens = ref.generate(tokenizer.encode(EMOJI), 6)
    expected = ref.text(tokens)
    assert _splits_characters(ref, tokens) and "\ufffd" not in expected
    chunks = list(client.completions.create(model=MODEL, prompt=EMOJI, max_tokens=6, temperature=0, stream=True))
    deltas = [c.choices[0].text for c in chunks]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == expected
