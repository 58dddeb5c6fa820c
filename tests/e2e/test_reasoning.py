"""A reasoning model behind a real server: the thinking apart from the answer in chat (streamed and not), its
token count, its budget, structured outputs after it, and the chat template's switches.

The model is `tests.support.reasoning_model`'s (the fixtures are in conftest.py): a tiny random Qwen3 whose
vocabulary has `<think>` and `</think>`; served with a template that opens the thinking in the prompt (as
DeepSeek-R1's does), everything it writes is thinking until the budget forces the closing tag: a random model's
output, made deterministic by greedy decoding.
"""
from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest

from tests.support.reasoning_model import ASK
from tests.support.reasoning_stream import read_reasoning_stream
from tests.support.server_process import ServerProcess


@pytest.fixture(scope="module")
def r1(r1_server: ServerProcess) -> Iterator[openai.OpenAI]:
    """The model with a template that opens the thinking in the prompt (--chat-template)."""
    yield openai.OpenAI(base_url=f"{r1_server.base_url}/v1", api_key="-", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def qwen3(qwen3_server: ServerProcess) -> ServerProcess:
    """The model with its own (Qwen3's) template."""
    return qwen3_server


def _chat(client: openai.OpenAI, **extra: object):
    return client.chat.completions.create(model="hf", messages=ASK, temperature=0, max_tokens=24,
                                          extra_body=extra)


def test_a_budget_ends_the_thinking_and_the_answer_follows_apart(r1: openai.OpenAI) -> None:
    reply = _chat(r1, thinking_token_budget=5)
    message, usage = reply.choices[0].message, reply.usage
    thinking = message.model_extra["reasoning"]
    assert thinking and message.model_extra["reasoning_content"] == thinking
    assert "<think>" not in (message.content or "") and "</think>" not in (message.content or "")
    # five thinking tokens, then the forced closing tag, counted as thinking; the rest is the answer's
    assert usage.completion_tokens_details.reasoning_tokens == 6
    assert usage.completion_tokens == 24


def test_without_a_budget_it_thinks_to_max_tokens_and_the_answer_is_empty(r1: openai.OpenAI) -> None:
    reply = _chat(r1)
    assert reply.choices[0].message.content == "" and reply.choices[0].message.model_extra["reasoning"]
    assert reply.usage.completion_tokens_details.reasoning_tokens == 24


def test_streamed_thinking_comes_first_and_adds_up_to_the_answers(r1: openai.OpenAI) -> None:
    whole = _chat(r1, thinking_token_budget=5).choices[0].message
    stream = r1.chat.completions.create(model="hf", messages=ASK, temperature=0, max_tokens=24, stream=True,
                                        extra_body={"thinking_token_budget": 5})
    thinking, content, order = read_reasoning_stream(stream)
    assert (thinking, content) == (whole.model_extra["reasoning"], whole.content)
    assert order == sorted(order, key=["thinking", "answer"].index)  # no thinking after the answer began


def test_include_reasoning_false_drops_it_but_still_counts_it(r1: openai.OpenAI) -> None:
    reply = _chat(r1, thinking_token_budget=5, include_reasoning=False)
    assert reply.choices[0].message.model_extra.get("reasoning") is None
    assert reply.usage.completion_tokens_details.reasoning_tokens == 6


def test_a_json_schema_holds_the_answer_only(r1: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    reply = r1.chat.completions.create(
        model="hf", messages=ASK, temperature=0, max_tokens=64,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}},
        extra_body={"thinking_token_budget": 4})
    message = reply.choices[0].message
    assert message.model_extra["reasoning"]  # free text, not JSON
    jsonschema.validate(json.loads(message.content), schema)
    assert reply.choices[0].finish_reason == "stop"


def test_chat_template_kwargs_reach_the_template(qwen3: ServerProcess) -> None:
    def prompt_tokens(**extra: object) -> tuple[int, dict]:
        body = {"model": "hf", "messages": ASK, "max_tokens": 4, "temperature": 0, **extra}
        answer = httpx.post(f"{qwen3.base_url}/v1/chat/completions", json=body, timeout=60).json()
        return answer["usage"]["prompt_tokens"], answer["choices"][0]["message"]

    plain, _ = prompt_tokens()
    closed, message = prompt_tokens(chat_template_kwargs={"enable_thinking": False})
    # the template's empty thinking block: <think>, "\n\n", </think>, "\n\n"
    assert closed > plain
    assert message["reasoning"] is None  # the prompt closed the thinking: all answer


def test_a_forced_tool_call_comes_after_the_thinking(r1: openai.OpenAI) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                "parameters": {"type": "object", "properties": {
                                                    "city": {"type": "string", "maxLength": 2}},
                                                    "required": ["city"], "additionalProperties": False},
                                                "strict": True}}]
    reply = r1.chat.completions.create(model="hf", messages=ASK, temperature=0, max_tokens=256, tools=tools,
                                       tool_choice="required", parallel_tool_calls=False,
                                       extra_body={"thinking_token_budget": 4})
    message = reply.choices[0].message
    assert message.model_extra["reasoning"]  # free text: the call's grammar held back until it ended
    (call,) = message.tool_calls
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
    assert reply.choices[0].finish_reason == "tool_calls"


def test_the_servers_chat_template_kwargs_apply_and_a_request_overrides_them(
        tmp_path_factory: pytest.TempPathFactory, thinking_model_dir, qwen3: ServerProcess) -> None:
    from tests.support.reasoning_model import serving

    def prompt_tokens(base_url: str, **extra: object) -> int:
        body = {"model": "hf", "messages": ASK, "max_tokens": 1, "temperature": 0, **extra}
        return httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=60).json()["usage"]["prompt_tokens"]

    thinking, closed = prompt_tokens(qwen3.base_url), prompt_tokens(qwen3.base_url,
                                                                     chat_template_kwargs={"enable_thinking": False})
    with serving(tmp_path_factory.mktemp("kwargs"), thinking_model_dir,
                 "--chat-template-kwargs", '{"enable_thinking": false}') as srv:
        assert prompt_tokens(srv.base_url) == closed
        assert prompt_tokens(srv.base_url, chat_template_kwargs={"enable_thinking": True}) == thinking
