"""Structured outputs, tool calls and embeddings on a real `--device cuda` server (skipped without CUDA; run on the
GPU machine): random weights, so every valid answer comes from the grammar's token bitmask applied on the GPU."""
from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import openai
import pytest
import torch

from bench.synthetic_model import Shape, write_model_dir
from tests.support.server_process import start_server, stop_server

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
SMALL = Shape("llama", 256, 4, 4, 2, 64, 512, 49152, 10000.0)
MODEL = "synthetic"
SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green"]}, "n": {"type": "integer"}},
          "required": ["colour", "n"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"q": {"type": "string", "maxLength": 8}}, "required": ["q"],
    "additionalProperties": False}}}]


def check_constrained_server(device: str, model_dir) -> None:
    """The checks, on a server of `device` (a CPU run of the same function is how this file is checked locally)."""
    srv = start_server(model_dir.parent, "--model", str(model_dir), "--device", device, "--served-model-name", MODEL,
                       "--embeddings", "--max-running", "32")
    try:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
        ask = [{"role": "user", "content": "colour?"}]
        fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA, "strict": True}}
        # n rows of one constrained request and unconstrained rows of another share the batch
        r = client.chat.completions.create(model=MODEL, messages=ask, n=8, temperature=1.0, seed=3, max_tokens=96,
                                           response_format=fmt, logprobs=True)
        plain = client.completions.create(model=MODEL, prompt="hello", max_tokens=16, temperature=0)
        assert plain.choices[0].finish_reason == "length"
        for choice in r.choices:
            assert choice.finish_reason == "stop", choice
            jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        got = client.completions.create(model=MODEL, prompt="x", max_tokens=16, temperature=1.0,
                                        extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-c]{2}"}})
        assert re.fullmatch("[0-9]{3}-[a-c]{2}", got.choices[0].text), got.choices[0].text
        call = client.chat.completions.create(model=MODEL, messages=ask, tools=TOOLS, max_tokens=200,
                                              tool_choice={"type": "function", "function": {"name": "lookup"}},
                                              parallel_tool_calls=False)
        assert call.choices[0].finish_reason == "tool_calls"
        args = json.loads(call.choices[0].message.tool_calls[0].function.arguments)
        assert isinstance(args["q"], str) and len(args["q"]) <= 8
        emb = client.embeddings.create(model=MODEL, input=["one", "two three"], encoding_format="float")
        vectors = np.array([d.embedding for d in emb.data])
        assert vectors.shape == (2, SMALL.hidden)
        np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-3)
    finally:
        stop_server(srv)
    assert "Traceback" not in srv.log(), srv.log()[-3000:]


def test_constrained_rows_tools_and_embeddings_on_cuda(tmp_path) -> None:
    model = write_model_dir(SMALL, tmp_path / "model", device="cuda")
    check_constrained_server("cuda", model.path)
