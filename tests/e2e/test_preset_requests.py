"""Presets through the official openai client on the suite's server (no --preset; the model's own defaults are
sampled, temperature 0.2): a request naming `precise` is greedy, the engine's greedy reference; an unknown name is a
400 naming the field and the presets."""
from __future__ import annotations

import openai
import pytest

from server.config.presets import PRESETS

MODEL = "smollm2-135m"
ASK = [{"role": "user", "content": "Name three colors."}]


def test_a_request_naming_a_preset_runs_with_its_values(client: openai.OpenAI, ref) -> None:
    greedy = ref.text(ref.generate(ref.chat_ids(ASK), 8))
    chat = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, extra_body={"preset": "precise"})
    assert chat.choices[0].message.content == greedy
    prompt = "The three primary colors are"
    text = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, extra_body={"preset": "precise"})
    explicit = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert text.choices[0].text == explicit.choices[0].text
    # fields the request sets win over its preset: precise with a temperature of its own samples (seeded: twice
    # the same), and not the greedy tokens
    hot = {"model": MODEL, "messages": ASK, "max_tokens": 8, "temperature": 2.0, "seed": 5,
           "extra_body": {"preset": "precise"}}
    first, again = (client.chat.completions.create(**hot).choices[0].message.content for _ in range(2))
    assert first == again and first != greedy


def test_an_unknown_preset_is_a_400_listing_the_presets(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, extra_body={"preset": "warm"})
    error = bad.value.body
    assert bad.value.status_code == 400 and error["param"] == "preset"
    assert all(name in error["message"] for name in PRESETS)
