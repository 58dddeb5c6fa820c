"""Each request field of /v1/chat/completions and /v1/completions, shown to have its effect on the real server.

Expected values come from outside the server: greedy decoding with the engine in this process (same weights, fp32),
the tokenizer (counts) and the documented formulas (penalties, bias, logprobs). Requests ask for few tokens.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence

import httpx
import openai
import pytest
import torch

from tests.support.greedy_reference import Reference, spanning_stop

MODEL = "smollm2-135m"
POEM = [{"role": "user", "content": "Write a short poem about the sea."}]
SHORT_ANSWER = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]  # a greedy answer ends early
CAPITAL = "The capital of France is"
COUNT = "Count from 1 to 20:"
STORY = "Once upon a time"
CATS = "Repeat the word cat many times: cat cat cat"


# ---- model, endpoints ----

def test_models_list_and_retrieve(client: openai.OpenAI, http: httpx.Client) -> None:
    listed = client.models.list()
    assert [m.id for m in listed.data] == [MODEL]
    assert listed.data[0].object == "model"
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model" and isinstance(card.created, int)
    raw = http.get("/v1/models").json()
    assert raw["object"] == "list" and raw["data"][0]["id"] == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_model_field_names_the_served_model(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=POEM, max_tokens=1, temperature=0)
    assert r.model == MODEL
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=POEM, max_tokens=1)


def test_tokenize_and_detokenize(http: httpx.Client, tokenizer) -> None:
    text = "Héllo, wörld! 你好 ☀️"
    r = http.post("/tokenize", json={"model": MODEL, "prompt": text}).json()
    assert r["tokens"] == tokenizer.encode(text) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] > 0
    r = http.post("/tokenize", json={"model": MODEL, "messages": POEM}).json()
    assert r["tokens"] == tokenizer.apply_chat_template(POEM, add_generation_prompt=True)
    assert r["count"] == len(r["tokens"])
    ids = tokenizer.encode(text)
    back = http.post("/detokenize", json={"model": MODEL, "tokens": ids}).json()
    assert back["prompt"] == text == tokenizer.decode(ids)


def test_openapi_lists_every_endpoint(http: httpx.Client) -> None:
    paths = http.get("/openapi.json").json()["paths"]
    expected = {"/v1/chat/completions": "post", "/v1/completions": "post", "/v1/models": "get",
                "/v1/models/{model_id}": "get", "/tokenize": "post", "/detokenize": "post", "/health": "get"}
    for path, method in expected.items():
        assert path in paths, f"{path} missing from /openapi.json: {sorted(paths)}"
        assert method in paths[path]


# ---- temperature 0, max_tokens, prompts, messages ----

def test_completions_temperature_zero_is_greedy(client: openai.OpenAI, ref: Reference, tokenizer) -> None:
    ids = tokenizer.encode(CAPITAL)
    expected = ref.generate(ids, 8)
    assert ref.finish_reason(expected) == "length"
    r = client.completions.create(model=MODEL, prompt=CAPITAL, max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.model == MODEL
    assert r.choices[0].text == ref.text(expected)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == len(expected) == 8
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.total_tokens == len(ids) + 8


def test_chat_temperature_zero_is_greedy(client: openai.OpenAI, ref: Reference) -> None:
    ids = ref.chat_ids(POEM)
    expected = ref.generate(ids, 8)
    r = client.chat.completions.create(model=MODEL, messages=POEM, max_tokens=8, temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.text(expected)
    assert r.choices[0].finish_reason == ref.finish_reason(expected) == "length"
    assert r.usage.completion_tokens == 8
    assert r.usage.prompt_tokens == len(ids)


def test_chat_max_completion_tokens(client: openai.OpenAI, ref: Reference) -> None:
    expected = ref.generate(ref.chat_ids(POEM), 4)
    r = client.chat.completions.create(model=MODEL, messages=POEM, max_completion_tokens=4, temperature=0)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 4
    assert r.choices[0].message.content == ref.text(expected)


def test_completions_prompt_forms(client: openai.OpenAI, ref: Reference, tokenizer) -> None:
    ids = [tokenizer.encode(CAPITAL), tokenizer.encode(COUNT)]
    expected = [ref.text(ref.generate(p, 5)) for p in ids]
    assert expected[0] != expected[1]

    r = client.completions.create(model=MODEL, prompt=[CAPITAL, COUNT], max_tokens=5, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == expected
    assert r.usage.prompt_tokens == len(ids[0]) + len(ids[1])
    assert r.usage.completion_tokens == 10

    r = client.completions.create(model=MODEL, prompt=ids[0], max_tokens=5, temperature=0)
    assert [c.text for c in r.choices] == expected[:1]
    assert r.usage.prompt_tokens == len(ids[0])

    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == expected


def test_chat_messages_roles_and_text_parts(client: openai.OpenAI, ref: Reference) -> None:
    messages = [{"role": "system", "content": "You are a geography tutor."},
                {"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "Paris."},
                {"role": "user", "content": "And of Italy?"}]
    parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in messages]
    ids = ref.chat_ids(messages)
    assert len(ids) != len(ref.chat_ids(messages[-1:]))  # the system and earlier turns are part of the prompt
    expected = ref.text(ref.generate(ids, 6))
    for msgs in (messages, parts):
        r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0)
        assert r.usage.prompt_tokens == len(ids)
        assert r.choices[0].message.content == expected


def test_ignore_eos_and_min_tokens(client: openai.OpenAI, ref: Reference) -> None:
    ids = ref.chat_ids(SHORT_ANSWER)
    natural = ref.generate(ids, 8)
    assert ref.finish_reason(natural) == "stop" and len(natural) < 5, "the prompt must end early by itself"
    r = client.chat.completions.create(model=MODEL, messages=SHORT_ANSWER, max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == len(natural)  # the end token counts, as in OpenAI and vLLM
    assert r.choices[0].message.content == ref.text(natural)

    # ignore_eos: the end token is generated and decoding goes on to max_tokens.
    through = ref.generate(ids, 8, stop_at_end=False)
    r = client.chat.completions.create(model=MODEL, messages=SHORT_ANSWER, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 8
    assert r.choices[0].message.content == ref.text(through)

    # min_tokens (vLLM): the end tokens cannot be generated before min_tokens tokens exist.
    def no_end_yet(x: torch.Tensor, out: list[int]) -> torch.Tensor:
        if len(out) < 5:
            x[list(ref.end_ids)] = -math.inf
        return x

    held = ref.generate(ids, 8, adjust=no_end_yet)
    r = client.chat.completions.create(model=MODEL, messages=SHORT_ANSWER, max_tokens=8, temperature=0,
                                       extra_body={"min_tokens": 5})
    assert r.usage.completion_tokens == len(held) >= 5
    assert r.choices[0].finish_reason == ref.finish_reason(held)
    assert r.choices[0].message.content == ref.text(held)


# ---- sampling truncation: each reduces temperature 1.5 to greedy ----

@pytest.mark.parametrize("truncation, seeds", [
    ({"top_p": 1e-6}, [1, 2, 3]),
    ({"extra_body": {"top_k": 1}}, [1, 2]),
    ({"extra_body": {"min_p": 1.0}}, [1, 2]),
], ids=["top_p", "top_k", "min_p"])
def test_truncation_at_high_temperature_is_greedy(client: openai.OpenAI, ref: Reference, tokenizer,
                                                  truncation: dict, seeds: list[int]) -> None:
    expected = ref.text(ref.generate(tokenizer.encode(STORY), 6))
    for seed in seeds:
        r = client.completions.create(model=MODEL, prompt=STORY, max_tokens=6, temperature=1.5, seed=seed,
                                      **truncation)
        assert r.choices[0].text == expected, f"seed {seed}"


def test_high_temperature_without_truncation_is_not_greedy(client: openai.OpenAI, ref: Reference,
                                                           tokenizer) -> None:
    """The control for the truncation test: the same requests without truncation do sample."""
    expected = ref.text(ref.generate(tokenizer.encode(STORY), 6))
    texts = [client.completions.create(model=MODEL, prompt=STORY, max_tokens=6, temperature=1.5, top_p=1.0,
                                       seed=seed).choices[0].text for seed in (1, 2)]
    assert any(t != expected for t in texts)


# ---- penalties ----

def _max_repeats(tokens: Sequence[int]) -> int:
    return max(Counter(tokens).values())


@pytest.mark.parametrize("field, value", [("frequency_penalty", 2.0), ("presence_penalty", 2.0),
                                          ("repetition_penalty", 2.0)])
def test_penalties(client: openai.OpenAI, ref: Reference, tokenizer, field: str, value: float) -> None:
    ids = tokenizer.encode(CATS)
    plain = ref.generate(ids, 10)
    assert _max_repeats(plain) >= 8, "the prompt must make the model repeat itself"

    def penalised(x: torch.Tensor, out: list[int]) -> torch.Tensor:
        # OpenAI: frequency and presence over the generated tokens; HF/vLLM: repetition over prompt + generated.
        counts = Counter(out)
        if field == "repetition_penalty":
            for t in set(ids) | set(out):
                x[t] = x[t] / value if x[t] > 0 else x[t] * value
        else:
            for t, c in counts.items():
                x[t] -= value * (c if field == "frequency_penalty" else 1)
        return x

    expected = ref.generate(ids, 10, adjust=penalised)
    assert _max_repeats(expected) < _max_repeats(plain)
    body = {field: value} if field != "repetition_penalty" else {"extra_body": {field: value}}
    r = client.completions.create(model=MODEL, prompt=CATS, max_tokens=10, temperature=0, **body)
    text = r.choices[0].text
    assert text == ref.text(expected)
    assert text != ref.text(plain)
    assert _max_repeats(tokenizer.encode(text)) < _max_repeats(plain)


# ---- seed and n ----

def test_seed_and_n_completions(client: openai.OpenAI) -> None:
    def run(seed: int, n: int) -> list[str]:
        r = client.completions.create(model=MODEL, prompt=STORY, max_tokens=6, temperature=1.0, top_p=1.0,
                                      seed=seed, n=n)
        assert [c.index for c in r.choices] == list(range(n))
        assert all(c.finish_reason in ("stop", "length") for c in r.choices)
        assert n <= r.usage.completion_tokens <= 6 * n
        return [c.text for c in r.choices]

    first = run(1234, 3)
    assert run(1234, 3) == first
    assert len(set(first)) > 1, "the n choices must be sampled independently"
    others = [run(seed, 1)[0] for seed in (7, 8)]
    assert len({first[0], *others}) > 1


def test_seed_and_n_chat(client: openai.OpenAI) -> None:
    def run(seed: int) -> list[str]:
        r = client.chat.completions.create(model=MODEL, messages=POEM, max_tokens=6, temperature=1.0, top_p=1.0,
                                           seed=seed, n=2)
        assert [c.index for c in r.choices] == [0, 1]
        assert all(c.finish_reason in ("stop", "length") for c in r.choices)
        return [c.message.content for c in r.choices]

    first = run(99)
    assert run(99) == first
    assert len({*first, *run(100)}) > 1


# ---- logit_bias ----

def test_logit_bias_forces_a_token(client: openai.OpenAI, tokenizer) -> None:
    (cat,) = tokenizer.encode(" cat")
    piece = tokenizer.token_bytes(cat).decode()
    r = client.completions.create(model=MODEL, prompt=CAPITAL, max_tokens=5, temperature=1.0, seed=3,
                                  logit_bias={str(cat): 100}, logprobs=0)
    choice = r.choices[0]
    assert choice.text == piece * 5
    assert choice.logprobs.tokens == [piece] * 5
    assert r.usage.completion_tokens == 5


def test_logit_bias_bans_the_greedy_token(client: openai.OpenAI, ref: Reference) -> None:
    ids = ref.chat_ids(POEM)
    greedy = ref.generate(ids, 6)
    banned = greedy[0]

    def ban(x: torch.Tensor, out: list[int]) -> torch.Tensor:
        x[banned] -= 100
        return x

    expected = ref.generate(ids, 6, adjust=ban)
    assert expected[0] != banned
    r = client.chat.completions.create(model=MODEL, messages=POEM, max_tokens=6, temperature=0,
                                       logit_bias={str(banned): -100}, logprobs=True)
    assert r.choices[0].message.content == ref.text(expected)
    got = [bytes(e.bytes) for e in r.choices[0].logprobs.content]
    assert got == [ref.tok.token_bytes(t) for t in expected]
    assert ref.tok.token_bytes(banned) not in got


# ---- stop ----

def test_stop_string_chat(client: openai.OpenAI, ref: Reference) -> None:
    tokens = ref.generate(ref.chat_ids(POEM), 16)
    text = ref.text(tokens)
    stop, needed = spanning_stop(ref.text, tokens, 4)
    r = client.chat.completions.create(model=MODEL, messages=POEM, max_tokens=16, temperature=0, stop=stop)
    assert r.choices[0].message.content == text[:text.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == needed


def test_stop_list_completions(client: openai.OpenAI, ref: Reference, tokenizer) -> None:
    tokens = ref.generate(tokenizer.encode(CAPITAL), 12)
    text = ref.text(tokens)
    stop, needed = spanning_stop(ref.text, tokens, 3)
    false_start = text[:5] + "\x07"  # matches the start of the output, then does not: that text must still come
    assert false_start not in text
    r = client.completions.create(model=MODEL, prompt=CAPITAL, max_tokens=12, temperature=0,
                                  stop=[false_start, stop])
    assert r.choices[0].text == text[:text.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == needed


# ---- logprobs, echo ----

def test_chat_logprobs(client: openai.OpenAI, ref: Reference) -> None:
    ids = ref.chat_ids(POEM)
    tokens = ref.generate(ids, 6)
    logp = ref.logprobs(ids, tokens)
    r = client.chat.completions.create(model=MODEL, messages=POEM, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=5)
    content = r.choices[0].logprobs.content
    assert len(content) == len(tokens) == r.usage.completion_tokens
    for i, (entry, token) in enumerate(zip(content, tokens)):
        assert bytes(entry.bytes) == ref.tok.token_bytes(token)
        assert bytes(entry.bytes).decode() == entry.token
        assert entry.logprob == pytest.approx(logp[i, token].item(), abs=1e-3)
        top = entry.top_logprobs
        assert len(top) == 5
        assert top[0].token == entry.token and top[0].logprob == entry.logprob  # greedy: the chosen one is top-1
        values = [t.logprob for t in top]
        assert values == sorted(values, reverse=True)
        assert sum(math.exp(v) for v in values) <= 1 + 1e-5
        ref_vals, ref_ids = logp[i].topk(5)
        assert [bytes(t.bytes) for t in top] == [ref.tok.token_bytes(t) for t in ref_ids.tolist()]
        assert values == pytest.approx(ref_vals.tolist(), abs=1e-3)
        for t in top:
            try:
                assert bytes(t.bytes).decode() == t.token
            except UnicodeDecodeError:  # a token that is part of a character: its text is the server's choice
                pass
    assert b"".join(bytes(e.bytes) for e in content).decode() == r.choices[0].message.content


def test_completions_logprobs(client: openai.OpenAI, ref: Reference, tokenizer) -> None:
    ids = tokenizer.encode(CAPITAL)
    tokens = ref.generate(ids, 6)
    logp = ref.logprobs(ids, tokens)
    r = client.completions.create(model=MODEL, prompt=CAPITAL, max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    for i in range(1, 6):
        assert lp.text_offset[i] > lp.text_offset[i - 1]
        assert lp.text_offset[i] - lp.text_offset[0] == len("".join(lp.tokens[:i]))
    for i, token in enumerate(tokens):
        assert lp.tokens[i] == ref.tok.token_bytes(token).decode()
        assert lp.token_logprobs[i] == pytest.approx(logp[i, token].item(), abs=1e-3)
        top = lp.top_logprobs[i]
        assert 1 <= len(top) <= 3
        assert top[lp.tokens[i]] == lp.token_logprobs[i] == max(top.values())
        ref_vals, ref_ids = logp[i].topk(3)
        for t, v in zip(ref_ids.tolist(), ref_vals.tolist()):
            assert top[ref.tok.token_bytes(t).decode()] == pytest.approx(v, abs=1e-3)


def test_echo(client: openai.OpenAI, ref: Reference, tokenizer) -> None:
    ids = tokenizer.encode(CAPITAL)
    tokens = ref.generate(ids, 3)
    r = client.completions.create(model=MODEL, prompt=CAPITAL, max_tokens=3, temperature=0, echo=True)
    assert r.choices[0].text == CAPITAL + ref.text(tokens)

    r = client.completions.create(model=MODEL, prompt=CAPITAL, max_tokens=3, temperature=0, echo=True, logprobs=2)
    choice = r.choices[0]
    assert choice.text == CAPITAL + ref.text(tokens)
    lp = choice.logprobs
    everything = ids + tokens
    assert lp.tokens == [ref.tok.token_bytes(t).decode() for t in everything]
    assert "".join(lp.tokens) == choice.text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    logp = torch.log_softmax(ref.runner.predict_logits(everything[:-1]).float(), -1)
    for i in range(1, len(everything)):
        assert lp.token_logprobs[i] == pytest.approx(logp[i - 1, everything[i]].item(), abs=1e-3)
        best = logp[i - 1].topk(1)
        assert max(lp.top_logprobs[i].values()) == pytest.approx(best.values.item(), abs=1e-3)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 3


def test_echo_logprobs_of_a_long_prompt(client: openai.OpenAI, ref: Reference, tokenizer) -> None:
    """A 1,090-token prompt (prefilled in chunks of 512), scored the way lm-evaluation-harness does: every prompt
    token gets its logprob, the first None; the same again when the prompt's prefix is cached (prompt logprobs are
    computed, not skipped, for cached prefixes)."""
    text = " ".join(f"item {i} of the list is {i * 7 % 13}." for i in range(110))
    ids = tokenizer.encode(text)[:1090]
    assert len(ids) == 1090
    logp = torch.log_softmax(ref.runner.predict_logits(ids).float(), -1)
    for attempt in ("cold", "cached"):
        r = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0, echo=True, logprobs=1)
        lp = r.choices[0].logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(ids) + 1, attempt
        assert lp.tokens[:len(ids)] == [ref.tok.token_bytes(t).decode("utf-8", "backslashreplace") for t in ids]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        worst = max(abs(lp.token_logprobs[i] - logp[i - 1, ids[i]].item()) for i in range(1, len(ids)))
        assert worst < 2e-3, (attempt, worst)
        assert lp.token_logprobs[len(ids)] == pytest.approx(logp[-1].max().item(), abs=2e-3)  # the greedy token


# ---- stream_options, user, unknown fields ----

def test_stream_include_usage(client: openai.OpenAI, ref: Reference) -> None:
    ids = ref.chat_ids(POEM)
    chunks = list(client.chat.completions.create(model=MODEL, messages=POEM, max_tokens=6, temperature=0,
                                                 logprobs=True, stream=True,
                                                 stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    generated = sum(len(c.choices[0].logprobs.content) for c in chunks[:-1]
                    if c.choices and c.choices[0].logprobs is not None)
    assert last.usage.prompt_tokens == len(ids)
    assert last.usage.completion_tokens == generated == 6
    assert last.usage.total_tokens == len(ids) + 6
    content = "".join(c.choices[0].delta.content or "" for c in chunks[:-1] if c.choices)
    assert content == ref.text(ref.generate(ids, 6))


def test_user_and_unknown_fields_are_accepted(client: openai.OpenAI, ref: Reference, http: httpx.Client) -> None:
    expected = ref.text(ref.generate(ref.chat_ids(POEM), 6))
    r = client.chat.completions.create(model=MODEL, messages=POEM, max_tokens=6, temperature=0, user="user-1234",
                                       extra_body={"foo": 1, "bar": {"nested": [1, 2]}})
    assert r.choices[0].message.content == expected
    raw = http.post("/v1/completions", json={"model": MODEL, "prompt": CAPITAL, "max_tokens": 1,
                                             "temperature": 0, "user": "u", "foo": 1})
    assert raw.status_code == 200, raw.text
