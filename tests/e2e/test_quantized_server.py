"""The server's default weight format on CPU (int4 weights, bfloat16 activations), end to end.

The rest of tests/e2e runs the exact float32 path (outputs compared bit for bit with the in-process engine);
this checks that the default the README promises is what a plain `serve` runs, and that it serves the same
tokens as the same format in-process.
"""
from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
import torch

from engine import load_runner
from tests.support.server_process import MODEL, ServerProcess, start_server, stop_server


@pytest.fixture(scope="module")
def default_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = start_server(tmp_path_factory.mktemp("default"), "--model", MODEL)
    yield srv
    stop_server(srv)


def test_default_format_is_int4_with_bfloat16_activations(default_server: ServerProcess) -> None:
    health = httpx.get(f"{default_server.base_url}/health").json()
    assert (health["quant"], health["dtype"], health["device"]) == ("int4", "bfloat16", "cpu")
    details = httpx.get(f"{default_server.base_url}/v1/models").json()["data"][0]["details"]
    assert (details["quant"], details["dtype"], details["quantization_level"]) == ("int4", "bfloat16", "Q4_1")
    assert "bfloat16 activations, int4 weights" in default_server.log()


def test_default_server_generates_what_the_engine_does_in_the_same_format(default_server: ServerProcess) -> None:
    runner = load_runner(MODEL)  # the same default: int4 weights, bfloat16
    assert runner.quant == "int4"
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    ids = runner.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    logits, expected = runner.prefill_logits(ids), []
    for _ in range(24):
        token = int(torch.argmax(logits))
        if token in runner.tokenizer.end_token_ids:
            break
        expected.append(token)
        logits = runner.decode_logits(token)
    client = openai.OpenAI(base_url=f"{default_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    reply = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24)
    assert reply.choices[0].message.content == runner.tokenizer.decode(expected, skip_special_tokens=True)
    assert "Paris" in reply.choices[0].message.content
