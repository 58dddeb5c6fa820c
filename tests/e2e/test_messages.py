"""POST /v1/messages and /v1/messages/count_tokens through the official anthropic client against the real server.

Greedy answers must be what /v1/chat/completions gives for the same conversation (they run the same path), with
Anthropic's stop reasons, usage, event stream and error envelope. (The x-api-key header is tested with the other
guards in test_operations.py.)
"""
from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.support.schema_cases import TIME, TOOL_SCHEMAS, WEATHER

MODEL = "smollm2-135m"
SYSTEM = "Answer briefly."
QUESTION = "What is 2+2?"
GREEDY = {"temperature": 0}  # the anthropic client has no sampling arguments any more: sent as extra fields
# The published order of a one-text-block message's events.
EVENT_ORDER = ["message_start", "content_block_start", "ping", "content_block_delta", "content_block_stop",
               "message_delta", "message_stop"]


@pytest.fixture(scope="module")
def claude(base_url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


def chat(client: openai.OpenAI, max_tokens: int, **fields: Any) -> Any:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0,
                                           **fields)
    return reply.choices[0], reply.usage


def ask(claude: anthropic.Anthropic, max_tokens: int, **fields: Any) -> anthropic.types.Message:
    # The user turn as text blocks, the system prompt as a string: both are the same chat as plain strings.
    return claude.messages.create(model=MODEL, max_tokens=max_tokens, system=SYSTEM, extra_body=GREEDY,
                                  messages=[{"role": "user", "content": [{"type": "text", "text": "What is "},
                                                                         {"type": "text", "text": "2+2?"}]}],
                                  **fields)


def test_greedy_messages_are_the_chat_completions_of_the_same_conversation(claude: anthropic.Anthropic,
                                                                           client: openai.OpenAI) -> None:
    m = ask(claude, 32)
    choice, usage = chat(client, 32)
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == choice.message.content
    assert (m.stop_reason, m.stop_sequence, choice.finish_reason) == ("end_turn", None, "stop")
    assert (m.type, m.role, m.model) == ("message", "assistant", MODEL) and m.id.startswith("msg_")
    # Anthropic counts cache reads apart from the input tokens.
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == usage.prompt_tokens
    assert m.usage.output_tokens == usage.completion_tokens

    cut = ask(claude, 3)
    assert cut.stop_reason == "max_tokens" and cut.stop_sequence is None and cut.usage.output_tokens == 3
    assert cut.content[0].text == chat(client, 3)[0].message.content

    word = choice.message.content.split()[2]  # a stop sequence the greedy answer reaches
    stopped = ask(claude, 32, stop_sequences=["never in this answer", word])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", word)
    assert stopped.content[0].text == chat(client, 32, stop=[word])[0].message.content


def test_streaming_sends_anthropics_events_and_the_same_text(claude: anthropic.Anthropic, http: httpx.Client) -> None:
    expected = ask(claude, 32)
    with claude.messages.stream(model=MODEL, max_tokens=32, system=SYSTEM, extra_body=GREEDY,
                                messages=[{"role": "user", "content": QUESTION}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == expected.content[0].text
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == expected.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        expected.usage.input_tokens + expected.usage.cache_read_input_tokens

    # On the wire: each `event:` names its data's type, in the published order.
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": QUESTION}], "stream": True}
    events, name = [], None
    with http.stream("POST", "/v1/messages", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                events.append((name, json.loads(line.removeprefix("data: "))))
    assert [n for n, _ in events] == [data["type"] for _, data in events]
    kinds = [n for n, _ in events]
    assert [k for i, k in enumerate(kinds) if i == 0 or kinds[i - 1] != k] == EVENT_ORDER  # deltas run together
    delta = next(data for n, data in events if n == "message_delta")
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 2


def test_count_tokens_is_the_prompt_the_chat_template_makes(claude: anthropic.Anthropic, http: httpx.Client) -> None:
    counted = claude.messages.count_tokens(model=MODEL, system=SYSTEM,
                                           messages=[{"role": "user", "content": QUESTION}])
    ids = http.post("/tokenize", json={"messages": [{"role": "system", "content": SYSTEM},
                                                    {"role": "user", "content": QUESTION}]}).json()
    assert counted.input_tokens == ids["count"] > 0


def assert_anthropic_envelope(r: httpx.Response, status: int, kind: str) -> str:
    """Exactly Anthropic's error envelope; returns the message."""
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind, body
    assert body["error"]["message"], body
    return body["error"]["message"]


# (body, status, Anthropic error type, words the message has)
BAD = {
    "no max_tokens": ({"messages": [{"role": "user", "content": "Hi"}]}, 400, "invalid_request_error", ["max_tokens"]),
    "image block": ({"max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
                    400, "invalid_request_error", ["image", "supported yet"]),
    "server tool": ({"max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}],
                     "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "invalid_request_error",
                    ["tools.0.type", "web_search_20250305"]),
    "tool_choice naming no tool": ({"max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}],
                                    "tools": [{"name": "f", "input_schema": {"type": "object"}}],
                                    "tool_choice": {"type": "tool", "name": "g"}}, 400, "invalid_request_error",
                                   ["tool_choice", "'g'"]),
    "input_schema not an object schema": ({"max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}],
                                           "tools": [{"name": "f", "input_schema": {"type": "string"}}]},
                                          400, "invalid_request_error", ["tools.0.input_schema", "object"]),
    "tool without input_schema": ({"max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}],
                                   "tools": [{"name": "f"}]}, 400, "invalid_request_error", ["tools.0.input_schema"]),
    "tool_choice tool without a name": ({"max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}],
                                         "tools": [{"name": "f", "input_schema": {"type": "object"}}],
                                         "tool_choice": {"type": "tool"}}, 400, "invalid_request_error",
                                        ["tool_choice.name"]),
    "tool_choice any without tools": ({"max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}],
                                       "tool_choice": {"type": "any"}}, 400, "invalid_request_error",
                                      ["tool_choice", "tools"]),
    "tool_result from the assistant": ({"max_tokens": 2, "messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "1"}]},
        {"role": "user", "content": "Hi"}]}, 400, "invalid_request_error", ["messages.1.content.0", "user"]),
    "assistant prefill": ({"max_tokens": 2, "messages": [{"role": "user", "content": "Hi"},
                                                         {"role": "assistant", "content": "Hel"}]},
                          400, "invalid_request_error", ["assistant"]),
    "five stop sequences": ({"max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}],
                             "stop_sequences": list("abcde")}, 400, "invalid_request_error", ["stop_sequences", "4"]),
    "temperature over 1": ({"max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}], "temperature": 1.5},
                           400, "invalid_request_error", ["temperature"]),
    "unknown model": ({"model": "claude-sonnet", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]},
                      404, "not_found_error", ["claude-sonnet"]),
    "too long for the context": ({"max_tokens": 10**6, "messages": [{"role": "user", "content": "Hi"}]},
                                 400, "invalid_request_error", ["context length"]),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_errors_answer_anthropics_envelope(http: httpx.Client, case: str) -> None:
    body, status, kind, words = BAD[case]
    message = assert_anthropic_envelope(http.post("/v1/messages", json={"model": MODEL, **body}), status, kind)
    assert all(w in message for w in words), message


def test_the_anthropic_client_raises_its_own_errors_and_other_routes_keep_openais(claude: anthropic.Anthropic,
                                                                                 http: httpx.Client) -> None:
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.messages.create(model="claude-sonnet", max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    assert missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.count_tokens(model=MODEL, messages=[])
    assert_anthropic_envelope(http.post("/v1/messages", content=b"{not json"), 400, "invalid_request_error")
    assert_anthropic_envelope(http.get("/v1/messages/nowhere"), 404, "not_found_error")
    assert_anthropic_envelope(http.get("/v1/messages"), 405, "invalid_request_error")
    assert set(http.post("/v1/chat/completions", content=b"{not json").json()) == {"error"}  # still OpenAI's


# ---- tools: chat's own machinery, so greedy calls are chat's ----

TOOLS = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER},
         {"name": "get_time", "description": "Local time in a zone", "input_schema": TIME}]
CHAT_TOOLS = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                "parameters": t["input_schema"]}} for t in TOOLS]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def tool_uses(m: anthropic.types.Message) -> list[Any]:
    uses = [b for b in m.content if b.type == "tool_use"]
    for use in uses:
        assert use.id.startswith("toolu_")
        jsonschema.validate(use.input, TOOL_SCHEMAS[use.name])
    return uses


def test_a_named_tool_is_used_with_valid_input_as_chat_calls_it(claude: anthropic.Anthropic,
                                                                 client: openai.OpenAI) -> None:
    choice = {"type": "tool", "name": "get_time"}
    m = claude.messages.create(model=MODEL, max_tokens=60, messages=ASK, tools=TOOLS, tool_choice=choice,
                               extra_body=GREEDY)
    [use] = tool_uses(m)
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"] and use.name == "get_time"
    chat = client.chat.completions.create(model=MODEL, messages=ASK, tools=CHAT_TOOLS, max_tokens=60, temperature=0,
                                          tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = chat.choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [(use.name, use.input)]
    # The prompt holds the tools (those tool_choice leaves): count_tokens counts them, as the answer's usage does.
    counted = claude.messages.count_tokens(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice).input_tokens
    assert counted == m.usage.input_tokens + m.usage.cache_read_input_tokens
    assert counted > claude.messages.count_tokens(model=MODEL, messages=ASK).input_tokens + 50


def test_a_tool_result_goes_into_the_next_turn(claude: anthropic.Anthropic, client: openai.OpenAI) -> None:
    first = claude.messages.create(model=MODEL, max_tokens=60, messages=ASK, tools=TOOLS,
                                   tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body=GREEDY)
    uses = tool_uses(first)
    results = [{"type": "tool_result", "tool_use_id": u.id, "content": [{"type": "text", "text": "18 degrees"}]}
               for u in uses]
    history = [*ASK, {"role": "assistant", "content": first.content}, {"role": "user", "content": results}]
    # tool_choice none: the answer is text (the earlier calls and results are still in the prompt).
    second = claude.messages.create(model=MODEL, max_tokens=24, messages=history, tools=TOOLS,
                                    tool_choice={"type": "none"}, extra_body=GREEDY)
    # The same conversation in chat's shape: assistant tool_calls, then tool messages.
    calls = [{"id": u.id, "type": "function", "function": {"name": u.name, "arguments": json.dumps(u.input)}}
             for u in uses]
    chat = client.chat.completions.create(
        model=MODEL, tools=CHAT_TOOLS, tool_choice="none", max_tokens=24, temperature=0,
        messages=[*ASK, {"role": "assistant", "content": "", "tool_calls": calls},
                  *[{"role": "tool", "tool_call_id": u.id, "content": "18 degrees"} for u in uses]])
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    # count_tokens reads the same blocks; a longer result is a longer prompt.
    count = {"model": MODEL, "tools": TOOLS, "tool_choice": {"type": "none"}}
    assert claude.messages.count_tokens(**count, messages=history).input_tokens == chat.usage.prompt_tokens
    longer = [{**r, "content": "18 degrees, sunny, a light wind from the west"} for r in results]
    assert claude.messages.count_tokens(**count, messages=[*history[:2], {"role": "user", "content": longer}]) \
        .input_tokens > chat.usage.prompt_tokens + 5 * len(uses)
    assert [b.type for b in second.content] == ["text"] and second.content[0].text == chat.choices[0].message.content
    assert second.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[chat.choices[0].finish_reason]


def test_streamed_input_json_deltas_concatenate_to_the_input(claude: anthropic.Anthropic) -> None:
    kwargs = dict(model=MODEL, max_tokens=80, messages=ASK, tools=TOOLS,
                  tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body=GREEDY)
    whole = claude.messages.create(**kwargs)
    with claude.messages.stream(**kwargs) as stream:
        events = [e for e in stream if e.type in ("message_start", "content_block_start", "ping",
                                                  "content_block_delta", "content_block_stop", "message_delta",
                                                  "message_stop")]
        final = stream.get_final_message()
    assert [b.type for b in whole.content] == ["tool_use"] and whole.stop_reason == "tool_use"  # one call: "any"
    starts = [e for e in events if e.type == "content_block_start"]
    assert [s.content_block.type for s in starts] == ["tool_use"] * len(tool_uses(whole))
    assert all(s.content_block.input == {} for s in starts)
    for s in starts:
        mine = [e for e in events if getattr(e, "index", None) == s.index]
        assert mine[0] is s and mine[-1].type == "content_block_stop"
        fragments = "".join(e.delta.partial_json for e in mine if e.type == "content_block_delta")
        assert all(e.delta.type == "input_json_delta" for e in mine if e.type == "content_block_delta")
        assert json.loads(fragments) == final.content[s.index].input == whole.content[s.index].input
    assert [(u.name, u.input) for u in tool_uses(final)] == [(u.name, u.input) for u in tool_uses(whole)]
    assert final.stop_reason == "tool_use" and events[-2].delta.stop_reason == "tool_use"
