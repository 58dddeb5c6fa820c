"""A reasoning model's thinking in the Responses API and the Messages API, through the official `openai` and
`anthropic` clients against a real server (`tests.support.reasoning_model`; the servers are conftest.py's).

With the template that opens the thinking in the prompt, the model thinks until its budget forces the closing tag,
then answers until max tokens: greedy, so every endpoint must give the chat endpoint's thinking, answer and counts
for the same request (they run the same path).
"""
from __future__ import annotations

from typing import Any

import anthropic
import openai
import pytest
from anthropic.types import TextBlock, ThinkingBlock
from openai.types.responses import ResponseOutputMessage, ResponseReasoningItem

from tests.support.reasoning_model import ASK
from tests.support.server_process import ServerProcess

PROMPT = ASK[0]["content"]
MAX = 24     # output tokens of every request: a budget's thinking and some answer
BUDGET = 5   # thinking tokens before the closing tag is forced
# A Responses stream's event types, runs of deltas as one: the reasoning item, then the message item.
RESPONSE_EVENTS = [
    "response.created", "response.in_progress",
    "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
    "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
    "response.output_item.added", "response.content_part.added", "response.output_text.delta",
    "response.output_text.done", "response.content_part.done", "response.output_item.done",
    "response.incomplete"]  # max_output_tokens ended it


@pytest.fixture(scope="module")
def oai(r1_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{r1_server.base_url}/v1", api_key="-", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(r1_server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=r1_server.base_url, api_key="-", max_retries=0, timeout=120)


def chat(client: openai.OpenAI, messages: list[dict[str, Any]] = ASK, max_tokens: int = MAX, **extra: Any) -> Any:
    """The chat endpoint's greedy answer: the reference every other endpoint is held to."""
    return client.chat.completions.create(model="hf", messages=messages, temperature=0, max_tokens=max_tokens,
                                          extra_body=extra)


def thinking_of(reply: Any) -> str:
    return reply.choices[0].message.model_extra.get("reasoning") or ""


def respond(client: openai.OpenAI, **fields: Any) -> Any:
    return client.responses.create(**{"model": "hf", "input": PROMPT, "temperature": 0, "max_output_tokens": MAX,
                                      **fields})


def without_ids(response: Any) -> dict[str, Any]:
    """A response as data, less what differs between two runs of one request (ids, creation time)."""
    data = response.model_dump(exclude={"id", "created_at"})
    for item in data["output"]:
        item.pop("id")
    return data


# ---- the Responses API ----

def test_a_response_opens_with_a_reasoning_item_then_the_answer(oai: openai.OpenAI) -> None:
    reference = chat(oai, thinking_token_budget=BUDGET)
    response = respond(oai, extra_body={"thinking_token_budget": BUDGET})
    reasoning, message = response.output
    assert isinstance(reasoning, ResponseReasoningItem) and isinstance(message, ResponseOutputMessage)
    assert reasoning.id.startswith("rs_") and reasoning.summary == [] and reasoning.status == "completed"
    assert [(c.type, c.text) for c in reasoning.content] == [("reasoning_text", thinking_of(reference))]
    assert reasoning.content[0].text
    assert response.output_text == message.content[0].text == reference.choices[0].message.content
    assert "<think>" not in response.output_text and "</think>" not in response.output_text
    usage, chat_usage = response.usage, reference.usage
    assert usage.output_tokens_details.reasoning_tokens == chat_usage.completion_tokens_details.reasoning_tokens > 0
    assert (usage.input_tokens, usage.output_tokens) == (chat_usage.prompt_tokens, chat_usage.completion_tokens)


def test_a_streamed_response_sends_the_reasoning_item_first_and_ends_as_the_whole_one(oai: openai.OpenAI) -> None:
    whole = respond(oai, extra_body={"thinking_token_budget": BUDGET})
    with oai.responses.stream(model="hf", input=PROMPT, temperature=0, max_output_tokens=MAX,
                              extra_body={"thinking_token_budget": BUDGET}) as stream:
        events = list(stream)  # no get_final_response(): it waits for response.completed, and this one is incomplete
    final = events[-1].response
    kinds = [e.type for e in events]
    assert [k for i, k in enumerate(kinds) if i == 0 or kinds[i - 1] != k] == RESPONSE_EVENTS
    assert [e.sequence_number for e in events] == list(range(len(events)))
    thinking = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    done = next(e for e in events if e.type == "response.reasoning_text.done")
    assert thinking == done.text == whole.output[0].content[0].text
    added = [e.item for e in events if e.type == "response.output_item.added"]
    finished = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(i.type, i.status) for i in added] == [("reasoning", "in_progress"), ("message", "in_progress")]
    assert [i.model_dump() for i in finished] == [i.model_dump() for i in final.output]
    assert all(e.item_id == added[0].id for e in events if e.type.startswith("response.reasoning_text"))
    assert without_ids(final) == without_ids(whole)


@pytest.mark.parametrize("effort", ["minimal", "low"])
def test_an_effort_is_the_chat_effort_s_budget(oai: openai.OpenAI, effort: str) -> None:
    """minimal is a budget of 0: the closing tag is forced first, so there is no thinking to show, only its tag to
    count; low's budget outlasts max_output_tokens here, so it thinks to the end (its answer empty)."""
    reference = chat(oai, reasoning_effort=effort)
    response = respond(oai, reasoning={"effort": effort, "summary": "auto"}, include=["reasoning.encrypted_content"])
    thinking = thinking_of(reference)
    assert (bool(thinking), bool(response.output_text)) == ((False, True) if effort == "minimal" else (True, False))
    shown = [(item.type, [c.text for c in item.content], item.summary) for item in response.output
             if isinstance(item, ResponseReasoningItem)]
    assert shown == ([("reasoning", [thinking], [])] if thinking else [])  # no summary is written
    assert response.output[-1].type == "message" and response.output_text == reference.choices[0].message.content
    assert response.usage.output_tokens_details.reasoning_tokens == \
        reference.usage.completion_tokens_details.reasoning_tokens
    assert response.reasoning.effort == effort and response.reasoning.summary == "auto"  # echoed


def test_earlier_thinking_goes_back_to_the_template(oai: openai.OpenAI) -> None:
    """The next turn's prompt has the last answer's thinking (this template writes it), whether the turn names the
    stored response or gives its output items back."""
    first = respond(oai, extra_body={"thinking_token_budget": BUDGET})
    again = {"role": "user", "content": "Again"}
    answered = {"role": "assistant", "content": first.output_text}
    thought = {**answered, "reasoning_content": first.output[0].content[0].text}
    with_thinking = chat(oai, [*ASK, thought, again], max_tokens=1).usage.prompt_tokens
    without = chat(oai, [*ASK, answered, again], max_tokens=1).usage.prompt_tokens
    assert with_thinking > without

    named = respond(oai, input="Again", previous_response_id=first.id, max_output_tokens=1)
    given_back = respond(oai, input=[*ASK, *[i.model_dump(exclude_none=True) for i in first.output], again],
                         max_output_tokens=1)
    assert named.usage.input_tokens == given_back.usage.input_tokens == with_thinking
    listed = oai.responses.input_items.list(given_back.id, order="asc").data
    assert [item.type for item in listed] == ["message", "reasoning", "message", "message"]


# ---- the Messages API ----

def ask(claude: anthropic.Anthropic, **fields: Any) -> anthropic.types.Message:
    return claude.messages.create(model="hf", max_tokens=MAX, messages=ASK, extra_body={"temperature": 0}, **fields)


def test_enabled_thinking_opens_the_message_with_a_thinking_block(claude: anthropic.Anthropic,
                                                                  oai: openai.OpenAI) -> None:
    reference = chat(oai, thinking_token_budget=BUDGET)
    message = ask(claude, thinking={"type": "enabled", "budget_tokens": BUDGET})
    thinking, text = message.content
    assert isinstance(thinking, ThinkingBlock) and isinstance(text, TextBlock)
    assert thinking.thinking == thinking_of(reference) != "" and thinking.signature == ""
    assert text.text == reference.choices[0].message.content
    assert message.usage.output_tokens == reference.usage.completion_tokens
    assert message.stop_reason == "max_tokens"


def test_streamed_thinking_comes_first_and_ends_as_the_whole_message(claude: anthropic.Anthropic) -> None:
    enabled = {"type": "enabled", "budget_tokens": BUDGET}
    whole = ask(claude, thinking=enabled)
    with claude.messages.stream(model="hf", max_tokens=MAX, messages=ASK, thinking=enabled,
                                extra_body={"temperature": 0}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    raw = [(e.type, getattr(e, "index", None), e.delta.type if e.type == "content_block_delta" else None)
           for e in events if e.type.startswith("content_block")]
    runs = [r for i, r in enumerate(raw) if i == 0 or raw[i - 1] != r]
    assert runs == [("content_block_start", 0, None), ("content_block_delta", 0, "thinking_delta"),
                    ("content_block_delta", 0, "signature_delta"), ("content_block_stop", 0, None),
                    ("content_block_start", 1, None), ("content_block_delta", 1, "text_delta"),
                    ("content_block_stop", 1, None)]
    starts = [e.content_block for e in events if e.type == "content_block_start"]
    assert isinstance(starts[0], ThinkingBlock) and isinstance(starts[1], TextBlock)
    thinking = "".join(e.delta.thinking for e in events
                       if e.type == "content_block_delta" and e.delta.type == "thinking_delta")
    assert thinking == whole.content[0].thinking
    assert final.model_dump(exclude={"id"}) == whole.model_dump(exclude={"id"})


def test_without_thinking_the_answer_leaves_it_out(claude: anthropic.Anthropic, oai: openai.OpenAI) -> None:
    """Generated and counted, but not shown: this template thinks until max_tokens, so the answer is empty where
    the chat endpoint shows the thinking."""
    reference = chat(oai)
    assert thinking_of(reference) and reference.choices[0].message.content == ""
    for fields in ({}, {"thinking": {"type": "disabled"}}):  # this template cannot skip the thinking
        message = ask(claude, **fields)
        assert [(b.type, b.text) for b in message.content] == [("text", "")]
        assert message.usage.output_tokens == reference.usage.completion_tokens


def test_disabled_thinking_asks_the_template_to_skip_it(qwen3_server: ServerProcess) -> None:
    """Qwen3's template closes the thinking in the prompt with enable_thinking false: the answer is all text,
    the chat endpoint's with that keyword."""
    client = anthropic.Anthropic(base_url=qwen3_server.base_url, api_key="-", max_retries=0, timeout=120)
    chat_client = openai.OpenAI(base_url=f"{qwen3_server.base_url}/v1", api_key="-", max_retries=0, timeout=120)
    reference = chat(chat_client, chat_template_kwargs={"enable_thinking": False})
    thinking_on = chat(chat_client)
    message = ask(client, thinking={"type": "disabled"})
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == reference.choices[0].message.content != ""
    counted = client.messages.count_tokens(model="hf", messages=ASK)
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == reference.usage.prompt_tokens > \
        thinking_on.usage.prompt_tokens == counted.input_tokens


def test_thinking_blocks_given_back_go_to_the_template(claude: anthropic.Anthropic, oai: openai.OpenAI) -> None:
    earlier = [{"type": "thinking", "thinking": "Foxes are quick.", "signature": ""},
               {"type": "text", "text": "Indeed"}]
    conversation = [*ASK, {"role": "assistant", "content": earlier}, {"role": "user", "content": "Again"}]
    counted = claude.messages.count_tokens(model="hf", messages=conversation)
    same = [*ASK, {"role": "assistant", "content": "Indeed", "reasoning_content": "Foxes are quick."},
            {"role": "user", "content": "Again"}]
    plain = [*ASK, {"role": "assistant", "content": "Indeed"}, {"role": "user", "content": "Again"}]
    assert counted.input_tokens == chat(oai, same, max_tokens=1).usage.prompt_tokens > \
        chat(oai, plain, max_tokens=1).usage.prompt_tokens
    redacted = [{"type": "redacted_thinking", "data": "opaque"}, {"type": "text", "text": "Indeed"}]
    conversation[1] = {"role": "assistant", "content": redacted}
    assert claude.messages.count_tokens(model="hf", messages=conversation).input_tokens == \
        chat(oai, plain, max_tokens=1).usage.prompt_tokens
