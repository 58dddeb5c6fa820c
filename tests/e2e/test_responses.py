"""POST /v1/responses and the stored responses, through the official openai client against the real server.

Greedy responses must be what /v1/chat/completions gives for the same conversation (they run the same path), the
stream must follow the published event order with consecutive sequence numbers, and chained turns must read the
last turn's tokens from the prefix cache.
"""
from __future__ import annotations

import json
import re
import typing
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from tests.support.schema_cases import TIME, TOOL_SCHEMAS, WEATHER

MODEL = "smollm2-135m"
BLOCK = 16  # the KV cache's block size: the prefix cache serves whole blocks
QUESTION = "What is 2+2?"
# Every event type the client knows, with its model (ResponseStreamEvent is Annotated[Union[...], ...]).
EVENT_TYPES = {typing.get_args(cls.model_fields["type"].annotation)[0]: cls
               for cls in typing.get_args(typing.get_args(ResponseStreamEvent)[0])}
# The published order of a text response's events (one output message with one output_text part).
PUBLISHED_ORDER = re.compile(r"response\.created response\.in_progress response\.output_item\.added "
                             r"response\.content_part\.added (response\.output_text\.delta )+"
                             r"response\.output_text\.done response\.content_part\.done response\.output_item\.done "
                             r"response\.(completed|incomplete)")


def chat_text(client: openai.OpenAI, messages: list[dict[str, str]], max_tokens: int) -> Any:
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)


def stream_events(http: httpx.Client, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The raw stream as (event name, data) pairs."""
    events, name = [], None
    with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                events.append((name, json.loads(line.removeprefix("data: "))))
                name = None
    return events


def test_greedy_responses_are_the_chat_completions_of_the_same_conversation(client: openai.OpenAI,
                                                                            http: httpx.Client) -> None:
    r = client.responses.create(model=MODEL, input=QUESTION, instructions="Answer briefly.", max_output_tokens=24,
                                temperature=0)
    chat = chat_text(client, [{"role": "system", "content": "Answer briefly."},
                              {"role": "user", "content": QUESTION}], 24)
    assert r.output_text == chat.choices[0].message.content and r.output_text
    assert r.status == "completed" and r.incomplete_details is None and chat.choices[0].finish_reason == "stop"
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    [message] = r.output
    assert (message.type, message.role, message.status) == ("message", "assistant", "completed")
    assert [part.type for part in message.content] == ["output_text"]
    assert r.instructions == "Answer briefly." and r.store is True and r.id.startswith("resp_")

    # A list of message items (text parts, an earlier answer given back) is the same chat too.
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Blue."}]},
             {"role": "user", "content": "Another one?"}]
    r = client.responses.create(model=MODEL, input=items, max_output_tokens=12, temperature=0, store=False)
    chat = chat_text(client, [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
                              {"role": "user", "content": "Another one?"}], 12)
    assert r.output_text == chat.choices[0].message.content

    # The JSON itself is a Response to the client's own model, and carries the output_text the client computes.
    raw = http.post("/v1/responses", json={"model": MODEL, "input": QUESTION, "max_output_tokens": 8,
                                           "temperature": 0, "store": False}).json()
    parsed = Response.model_validate(raw)
    assert raw["output_text"] == parsed.output_text == raw["output"][0]["content"][0]["text"]


def test_cut_by_max_output_tokens_is_incomplete(client: openai.OpenAI) -> None:
    r = client.responses.create(model=MODEL, input="Write a long story about a dragon.", max_output_tokens=3,
                                temperature=0, store=False)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and r.usage.output_tokens == 3 and r.output_text


def test_the_stream_follows_the_published_event_order(client: openai.OpenAI, http: httpx.Client) -> None:
    body = {"model": MODEL, "input": QUESTION, "max_output_tokens": 16, "temperature": 0, "store": False}
    events = stream_events(http, body)
    kinds = [data["type"] for _, data in events]
    assert PUBLISHED_ORDER.fullmatch(" ".join(kinds)), kinds
    assert [name for name, _ in events] == kinds  # each `event:` line names its data's type
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    for _, data in events:
        EVENT_TYPES[data["type"]].model_validate(data)  # the client's own models of each event
    text = "".join(data["delta"] for _, data in events if data["type"] == "response.output_text.delta")
    done = {data["type"]: data for _, data in events}
    final = done[kinds[-1]]["response"]
    assert text == done["response.output_text.done"]["text"] == final["output_text"]
    assert done["response.content_part.done"]["part"]["text"] == text
    assert done["response.output_item.done"]["item"] == final["output"][0]
    assert done["response.created"]["response"]["status"] == "in_progress"
    assert done["response.created"]["response"]["id"] == final["id"]
    item_id = done["response.output_item.added"]["item"]["id"]
    assert all(data["item_id"] == item_id for _, data in events if "item_id" in data)
    assert text == client.responses.create(**body).output_text  # what the same request answers unstreamed

    cut = stream_events(http, {**body, "max_output_tokens": 2})
    assert PUBLISHED_ORDER.fullmatch(" ".join(data["type"] for _, data in cut))
    assert cut[-1][1]["type"] == "response.incomplete"
    assert cut[-1][1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_the_clients_stream_helper_and_retrieve(client: openai.OpenAI) -> None:
    with client.responses.stream(model=MODEL, input=QUESTION, max_output_tokens=24, temperature=0) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text and final.output_text
    stored = client.responses.retrieve(final.id)
    # The helper's final response is a ParsedResponse (with `parsed` fields): compare what both have.
    for field in ("id", "created_at", "status", "output_text", "usage", "model", "temperature", "top_p"):
        assert getattr(stored, field) == getattr(final, field), field
    assert [m.id for m in stored.output] == [m.id for m in final.output]
    assert final.status == "completed"
    assert client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=24, temperature=0,
                                   store=False).output_text == final.output_text


def test_previous_response_id_chains_turns_from_the_prefix_cache(client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL, input=QUESTION, instructions="Be brief.", max_output_tokens=8,
                                    temperature=0)
    second = client.responses.create(model=MODEL, input="And 3+3?", instructions="Be brief.",
                                     previous_response_id=first.id, max_output_tokens=8, temperature=0)
    chat = chat_text(client, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION},
                              {"role": "assistant", "content": first.output_text},
                              {"role": "user", "content": "And 3+3?"}], 8)
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.previous_response_id == first.id
    # The second prompt begins with the first one: at least its whole blocks come from the cache.
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // BLOCK * BLOCK > 0

    # Instructions are not carried over to the next turn (as OpenAI does): without them it is the plain chat.
    third = client.responses.create(model=MODEL, input="And 3+3?", previous_response_id=first.id,
                                    max_output_tokens=8, temperature=0, store=False)
    chat = chat_text(client, [{"role": "user", "content": QUESTION},
                              {"role": "assistant", "content": first.output_text},
                              {"role": "user", "content": "And 3+3?"}], 8)
    assert third.output_text == chat.choices[0].message.content

    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model=MODEL, input="Hi", previous_response_id="resp_nope", max_output_tokens=2)
    assert missing.value.body["code"] == "previous_response_not_found"
    assert missing.value.body["param"] == "previous_response_id"


def test_input_items_delete_and_store_false(client: openai.OpenAI) -> None:
    items = [{"role": "user", "content": "One."}, {"role": "assistant", "content": "Two."},
             {"role": "user", "content": [{"type": "input_text", "text": "Three"},
                                          {"type": "input_text", "text": "."}]}]
    r = client.responses.create(model=MODEL, input=items, max_output_tokens=2, temperature=0)
    newest_first = list(client.responses.input_items.list(r.id))
    assert [(i.role, [p.text for p in i.content]) for i in newest_first] == [
        ("user", ["Three", "."]), ("assistant", ["Two."]), ("user", ["One."])]
    asc = client.responses.input_items.list(r.id, order="asc", limit=2)
    assert [i.role for i in asc.data] == ["user", "assistant"] and asc.has_more
    rest = client.responses.input_items.list(r.id, order="asc", after=asc.data[-1].id)
    assert [i.id for i in rest.data] == [newest_first[0].id] and not rest.has_more

    client.responses.delete(r.id)
    for call in (lambda: client.responses.retrieve(r.id), lambda: client.responses.delete(r.id),
                 lambda: client.responses.input_items.list(r.id)):
        with pytest.raises(openai.NotFoundError) as gone:
            call()
        assert gone.value.body["code"] == "response_not_found"

    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="Hi", previous_response_id=unstored.id, max_output_tokens=2)


# (body fields, the param the 400 names, words its message has)
REFUSED = {
    "hosted tool": ({"tools": [{"type": "web_search"}]}, "tools.0.type", ["web_search"]),
    "second tool hosted": ({"tools": [{"type": "function", "name": "f"}, {"type": "file_search"}]}, "tools.1.type",
                           ["file_search"]),
    "tool_choice naming no tool": ({"tools": [{"type": "function", "name": "f"}],
                                    "tool_choice": {"type": "function", "name": "g"}}, "tool_choice", ["'g'"]),
    "parameters not an object schema": ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "array"}}]},
                                        "tools.0.parameters", ["object"]),
    "tool without a name": ({"tools": [{"type": "function", "parameters": {}}]}, "tools.0.name", ["name"]),
    "json_schema without a schema": ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema",
                                     ["schema"]),
    "not a JSON schema": ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 5}}}},
                          "text.format.schema", ["JSON Schema"]),
    "unknown text format": ({"text": {"format": {"type": "yaml"}}}, "text.format.type", ["json_schema"]),
    "tool_choice required": ({"tool_choice": "required"}, "tool_choice", ["tools"]),
    "item_reference item": ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", ["item_reference"]),
    "image part": ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input",
                   ["input_image"]),
    "temperature 3": ({"temperature": 3}, "temperature", ["temperature"]),
    "too long for the context": ({"max_output_tokens": 10**6}, "max_output_tokens", ["context length"]),
    "no input": ({"input": None}, "input", ["input"]),
}


@pytest.mark.parametrize("case", REFUSED, ids=list(REFUSED))
def test_bad_or_unsupported_fields_are_a_400_naming_the_field(http: httpx.Client, case: str) -> None:
    fields, param, words = REFUSED[case]
    r = http.post("/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 2, **fields})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    assert all(w in error["message"] for w in words), error


def test_a_text_format_of_text_is_accepted(client: openai.OpenAI) -> None:
    r = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False,
                                text={"format": {"type": "text"}})
    assert r.text.format.type == "text" and r.status == "incomplete"


# ---- tools and structured formats: chat's own machinery, so greedy answers are chat's ----

TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER},
         {"type": "function", "name": "get_time", "description": "Local time in a zone", "parameters": TIME}]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]
ASK = "What is the weather in Paris?"
# A function call's events, in the published order: the item added, argument deltas, arguments done, item done.
CALL_ORDER = re.compile(r"response\.created response\.in_progress (response\.output_item\.added "
                        r"(response\.function_call_arguments\.delta )+response\.function_call_arguments\.done "
                        r"response\.output_item\.done )+response\.completed")


def calls_of(r: Response) -> list[Any]:
    calls = [item for item in r.output if item.type == "function_call"]
    for call in calls:
        assert call.id.startswith("fc_") and call.call_id.startswith("call_") and call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), TOOL_SCHEMAS[call.name])
    return calls


def test_a_named_function_is_called_with_arguments_valid_against_its_schema(client: openai.OpenAI) -> None:
    r = client.responses.create(model=MODEL, input=ASK, tools=TOOLS, max_output_tokens=60, temperature=0,
                                tool_choice={"type": "function", "name": "get_time"}, store=False)
    [call] = calls_of(r)
    assert r.status == "completed" and r.output_text == "" and [i.type for i in r.output] == ["function_call"]
    assert call.name == "get_time" and r.tool_choice.name == "get_time"
    # The same call chat makes for the same conversation (one path), and the request's tools echoed.
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}], tools=CHAT_TOOLS,
                                          tool_choice={"type": "function", "function": {"name": "get_time"}},
                                          max_tokens=60, temperature=0).choices[0].message
    assert [(c.function.name, c.function.arguments) for c in chat.tool_calls] == [(call.name, call.arguments)]
    assert [t.name for t in r.tools] == ["get_weather", "get_time"] and r.parallel_tool_calls is True


def test_a_function_call_output_goes_into_the_next_turn(client: openai.OpenAI) -> None:
    # One call at a time all along: the tools' prompt (which says how to call) stays the same for every turn.
    same = dict(model=MODEL, tools=TOOLS, parallel_tool_calls=False, temperature=0)
    first = client.responses.create(**same, input=ASK, tool_choice="required", max_output_tokens=60)
    [call] = calls_of(first)  # exactly one call (parallel_tool_calls false), and no text
    assert first.status == "completed" and first.output_text == "" and first.parallel_tool_calls is False
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees and sunny"}
    chained = client.responses.create(**same, previous_response_id=first.id, input=[result], max_output_tokens=24)
    # The same turn with the conversation sent whole: the call given back as an input item.
    resent = client.responses.create(**same, max_output_tokens=24, store=False,
                                     input=[{"role": "user", "content": ASK}, call.model_dump(exclude_none=True),
                                            result])
    assert chained.usage.input_tokens == resent.usage.input_tokens > first.usage.input_tokens + 10

    def answer(r: Response) -> list[tuple[Any, ...]]:  # a call may be cut short by max_output_tokens here
        return [(i.type, i.status, getattr(i, "name", None), getattr(i, "arguments", None),
                 [p.text for p in getattr(i, "content", [])]) for i in r.output]

    assert answer(chained) == answer(resent) and chained.output
    # The chained turn's prompt begins with the first one's (whole blocks from the prefix cache).
    assert chained.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // BLOCK * BLOCK > 0
    [item] = client.responses.input_items.list(chained.id).data
    assert (item.type, item.call_id, item.output) == ("function_call_output", call.call_id, "18 degrees and sunny")


def test_streamed_argument_deltas_concatenate_to_the_final_arguments(client: openai.OpenAI,
                                                                      http: httpx.Client) -> None:
    body = {"model": MODEL, "input": ASK, "tools": TOOLS, "tool_choice": "required", "max_output_tokens": 80,
            "temperature": 0, "store": False, "parallel_tool_calls": False}
    events = stream_events(http, body)
    kinds = [data["type"] for _, data in events]
    assert CALL_ORDER.fullmatch(" ".join(kinds)), kinds
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    for _, data in events:
        EVENT_TYPES[data["type"]].model_validate(data)
    final = events[-1][1]["response"]
    calls = [item for item in final["output"] if item["type"] == "function_call"]
    assert calls and calls == [data["item"] for _, data in events if data["type"] == "response.output_item.done"]
    for index, call in enumerate(calls):
        mine = [data for _, data in events if data.get("output_index") == index]
        assert mine[0]["item"] == {**call, "arguments": "", "status": "in_progress"}
        deltas = "".join(d["delta"] for d in mine if d["type"] == "response.function_call_arguments.delta")
        done = next(d for d in mine if d["type"] == "response.function_call_arguments.done")
        assert deltas == done["arguments"] == call["arguments"] and done["item_id"] == call["id"]
        jsonschema.validate(json.loads(deltas), TOOL_SCHEMAS[call["name"]])
    whole = client.responses.create(**body)  # unstreamed: the same calls (ids aside)
    assert [(c.name, c.arguments) for c in calls_of(whole)] == [(c["name"], c["arguments"]) for c in calls]


ANSWER = {"type": "object", "properties": {"answer": {"type": "integer"}, "why": {"type": "string", "maxLength": 30}},
          "required": ["answer", "why"], "additionalProperties": False}


def test_text_format_holds_the_output_to_json(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}
    r = client.responses.create(model=MODEL, input=QUESTION, text={"format": fmt}, max_output_tokens=60,
                                temperature=0, store=False)
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), ANSWER)
    assert r.text.format.type == "json_schema" and r.text.format.name == "answer"
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}})
    assert r.output_text == chat.choices[0].message.content
    anything = client.responses.create(model=MODEL, input="Describe a cat in JSON.", max_output_tokens=30,
                                       temperature=0, store=False, text={"format": {"type": "json_object"}})
    if anything.status == "completed":
        assert isinstance(json.loads(anything.output_text), dict)
    else:  # cut by max_output_tokens: still the start of an object
        assert anything.output_text.startswith("{")
