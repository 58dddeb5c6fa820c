"""The harmony format (gpt-oss) on a real server, through the official `openai` client: the analysis channel as the
reasoning apart from the final channel's answer (streamed and not), a tool call written in harmony parsed into
`tool_calls` (streamed and not), `reasoning_effort` (chat, Responses' `reasoning.effort`) in the template's system
message, and earlier calls and thinking given back to the template.

The model is `tests.support.harmony_model`'s: a tiny random model with gpt-oss's tokens and chat template, made to
write harmony by a thinking budget (the analysis channel opened by the prompt) or by a forced call's grammar.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from engine.tokenizer.tokenizer import Tokenizer
from tests.support.harmony_model import CONTROL_TOKENS, analysis_template, harmony_model
from tests.support.reasoning_model import serving
from tests.support.reasoning_stream import read_reasoning_stream
from tests.support.server_process import ServerProcess

ASK = [{"role": "user", "content": "The quick brown fox"}]
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Gets the weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris"]}},
                   "required": ["city"], "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return harmony_model(tmp_path_factory.mktemp("harmony"))


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained_dir(model_dir)


@pytest.fixture(scope="module")
def own(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[ServerProcess]:
    """The model with gpt-oss's own template."""
    with serving(tmp_path_factory.mktemp("own"), model_dir) as srv:
        yield srv


@pytest.fixture(scope="module")
def analysis(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[ServerProcess]:
    """The model with a template whose generation prompt opens the analysis channel."""
    tmp = tmp_path_factory.mktemp("analysis")
    with serving(tmp, model_dir, "--chat-template", str(analysis_template(tmp))) as srv:
        yield srv


def client(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="-", max_retries=0, timeout=60)


def banned(tokenizer: Tokenizer) -> dict[str, int]:
    """logit_bias banning every control token (a forced one still comes: the gate's mask leaves only it)."""
    return {str(tokenizer.backend.token_to_id(t)): -100 for t in CONTROL_TOKENS}


def thinking_then_answer(srv: ServerProcess, tokenizer: Tokenizer, **extra: object):
    return client(srv).chat.completions.create(
        model="hf", messages=ASK, temperature=0, max_tokens=40, logprobs=True, logit_bias=banned(tokenizer),
        extra_body={"thinking_token_budget": 5, **extra})


def test_the_analysis_is_the_reasoning_and_the_final_channel_the_answer(analysis: ServerProcess,
                                                                       tokenizer: Tokenizer) -> None:
    reply = thinking_then_answer(analysis, tokenizer)
    choice = reply.choices[0]
    message, usage = choice.message, reply.usage
    # the raw output, control tokens and all, from the tokens' logprobs: the reference split of it
    raw = b"".join(bytes(entry.bytes) for entry in choice.logprobs.content).decode("utf-8", errors="replace")
    thinking, rest = raw.split("<|end|>", 1)
    header, answer = rest.split("<|message|>", 1)
    assert header == "<|start|>assistant<|channel|>final"  # the budget's forced end of the analysis
    assert message.model_extra["reasoning"] == thinking == message.model_extra["reasoning_content"]
    assert message.content == answer
    assert thinking and answer and not any(t in thinking + answer for t in CONTROL_TOKENS)
    # five thinking tokens and the analysis' <|end|> are the reasoning; the final header is neither's
    assert usage.completion_tokens_details.reasoning_tokens == 6
    assert (usage.completion_tokens, choice.finish_reason) == (40, "length")


def test_streamed_reasoning_comes_first_and_adds_up_to_the_answers(analysis: ServerProcess,
                                                                  tokenizer: Tokenizer) -> None:
    whole = thinking_then_answer(analysis, tokenizer).choices[0].message
    stream = client(analysis).chat.completions.create(
        model="hf", messages=ASK, temperature=0, max_tokens=40, logit_bias=banned(tokenizer), stream=True,
        extra_body={"thinking_token_budget": 5})
    thinking, content, order = read_reasoning_stream(stream)
    assert (thinking, content) == (whole.model_extra["reasoning"], whole.content)
    assert order == sorted(order, key=["thinking", "answer"].index)


def call_weather(srv: ServerProcess, tokenizer: Tokenizer, stream: bool = False):
    # named: the call's grammar writes it; <|end|> favoured, so that an analysis the model opens first ends at once
    return client(srv).chat.completions.create(
        model="hf", messages=[{"role": "user", "content": "Weather in Paris?"}], temperature=0, max_tokens=128,
        tools=WEATHER, tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=stream,
        logit_bias={str(tokenizer.backend.token_to_id("<|end|>")): 100})


def test_a_harmony_call_is_a_tool_call(own: ServerProcess, tokenizer: Tokenizer) -> None:
    reply = call_weather(own, tokenizer)
    choice = reply.choices[0]
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert choice.message.content is None and choice.finish_reason == "tool_calls"
    assert not choice.message.model_extra.get("reasoning")  # an analysis, if any, ended at once


def test_a_streamed_harmony_call_comes_as_tool_call_deltas(own: ServerProcess, tokenizer: Tokenizer) -> None:
    whole = call_weather(own, tokenizer).choices[0].message.tool_calls[0]
    first, arguments, content, finish = None, "", "", None
    for chunk in call_weather(own, tokenizer, stream=True):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        for delta in choice.delta.tool_calls or []:
            assert delta.index == 0
            if delta.id is not None:
                assert first is None  # id, type and name once, in the call's first delta
                first = (delta.type, delta.function.name)
            arguments += delta.function.arguments or ""
        content += choice.delta.content or ""
        finish = choice.finish_reason or finish
    assert first == ("function", "get_weather") and arguments == whole.function.arguments
    assert (content, finish) == ("", "tool_calls")


def prompt_text(srv: ServerProcess, **fields: object) -> tuple[str, int]:
    """The rendered prompt of ASK (/tokenize, then /detokenize), and its length."""
    ids = httpx.post(f"{srv.base_url}/tokenize", json={"messages": ASK, **fields}, timeout=60).json()["tokens"]
    text = httpx.post(f"{srv.base_url}/detokenize", json={"tokens": ids}, timeout=60).json()["prompt"]
    return text, len(ids)


def test_reasoning_effort_sets_the_templates_effort(own: ServerProcess, tokenizer: Tokenizer) -> None:
    default, _ = prompt_text(own)
    assert "\nReasoning: medium\n" in default  # the template's own default
    # the prompt's length at each of the template's efforts, rendered here: some efforts' spellings differ in length
    lengths = {w: len(tokenizer.apply_chat_template(ASK, reasoning_effort=w)) for w in ("low", "medium", "high")}
    assert len(set(lengths.values())) > 1
    for effort, written in (("high", "high"), ("low", "low"), ("minimal", "low"), ("xhigh", "high")):
        text, length = prompt_text(own, reasoning_effort=effort)
        assert text == default.replace("Reasoning: medium", f"Reasoning: {written}")
        assert length == lengths[written]
        # a chat with the effort has that prompt
        reply = client(own).chat.completions.create(model="hf", messages=ASK, max_tokens=1,
                                                    reasoning_effort=effort)
        assert reply.usage.prompt_tokens == length
    # the Responses API's reasoning.effort is the chat's reasoning_effort
    for written in ("low", "high"):
        response = client(own).responses.create(model="hf", input=ASK[0]["content"], max_output_tokens=16,
                                                reasoning={"effort": written})
        assert response.usage.input_tokens == lengths[written]


def test_earlier_calls_results_and_thinking_reach_the_template(own: ServerProcess) -> None:
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "reasoning_content": "Need the weather tool.",
                 "tool_calls": [{"id": "call_1", "type": "function",
                                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    ids = httpx.post(f"{own.base_url}/tokenize", json={"messages": messages}, timeout=60).json()["tokens"]
    text = httpx.post(f"{own.base_url}/detokenize", json={"tokens": ids}, timeout=60).json()["prompt"]
    assert re.search(r"<\|start\|>assistant<\|channel\|>analysis<\|message\|>Need the weather tool\.<\|end\|>"
                     r"<\|start\|>assistant to=functions\.get_weather<\|channel\|>commentary json<\|message\|>"
                     r'\{"city": "Paris"\}<\|call\|>'
                     r"<\|start\|>functions\.get_weather to=assistant<\|channel\|>commentary<\|message\|>"
                     r'"sunny"<\|end\|><\|start\|>assistant$', text), text
