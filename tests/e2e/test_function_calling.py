"""Tool calls on the real server (SmolLM2: the generic JSON format) with the official client: every tool_choice,
streamed deltas that reassemble exactly, a two-turn conversation with a tool result, and 400s naming the field."""
from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest

from tests.support.schema_cases import SCHEMAS as VARIED
from tests.support.schema_cases import TIME, TOOL_SCHEMAS, WEATHER


MODEL = "smollm2-135m"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Local time in a zone",
                                           "parameters": TIME}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _check_calls(message) -> None:
    assert message.tool_calls
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), TOOL_SCHEMAS[call.function.name])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_calls_are_valid(client, choice):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=60,
                                       n=2, temperature=1.0, seed=3, parallel_tool_calls=False)
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and c.message.content is None
        _check_calls(c.message)
        if isinstance(choice, dict):
            assert {call.function.name for call in c.message.tool_calls} == {"get_time"}


def test_forced_calls_over_varied_schemas_are_valid(aclient):
    """Every object schema of the shared cases (nested objects, arrays, enums, ranges, patterns, optional fields) as
    a tool's parameters, required or named, sampled: all requests at once, so they share the batch."""
    schemas = [s for s in VARIED if s.get("type") == "object"]
    assert len(schemas) >= 30
    tools = [{"type": "function", "function": {"name": f"fn_{i}", "parameters": s}} for i, s in enumerate(schemas)]

    async def one(i: int):
        choice = {"type": "function", "function": {"name": f"fn_{i}"}} if i % 2 else "required"
        offered = [tools[i]] if i % 2 else tools[i:i + 2]
        return await aclient.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Call the tool with sensible arguments."}],
            tools=offered, tool_choice=choice, parallel_tool_calls=False, max_tokens=200, temperature=0.8, seed=i)

    async def run():
        async with aclient:
            return await asyncio.gather(*(one(i) for i in range(len(schemas))))

    for i, r in enumerate(asyncio.run(run())):
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, (i, c)
        call = c.message.tool_calls[0]
        index = int(call.function.name.removeprefix("fn_"))
        assert index == i or (i % 2 == 0 and index == i + 1), (i, call)
        jsonschema.validate(json.loads(call.function.arguments), schemas[index])


def test_auto_answers_or_calls_and_none_never_calls(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=80,
                                       temperature=0)
    c = r.choices[0]
    if c.message.tool_calls:
        assert c.finish_reason == "tool_calls"
        _check_calls(c.message)
    else:
        assert c.message.content
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=30,
                                       temperature=0)
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("parallel", [True, False])
def test_streamed_deltas_reassemble_to_the_calls(client, parallel):
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=80, temperature=0,
                  parallel_tool_calls=parallel)
    whole = client.chat.completions.create(**kwargs).choices[0].message
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        finish = chunk.choices[0].finish_reason or finish
        assert not delta.content
        for d in delta.tool_calls or []:
            if d.index not in calls:
                assert d.id and d.function.name and d.type == "function"
                calls[d.index] = {"name": d.function.name, "arguments": d.function.arguments or ""}
            else:
                assert d.id is None and d.function.name is None
                calls[d.index]["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == \
        [(c.function.name, c.function.arguments) for c in whole.tool_calls]


def test_a_tool_result_goes_into_the_next_turn(aclient):
    async def conversation():
        async with aclient:
            first = await aclient.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                                          tool_choice="required", max_tokens=80, temperature=0)
            call = first.choices[0].message.tool_calls[0]
            history = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
                       {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
            second = await aclient.chat.completions.create(model=MODEL, messages=history, tools=TOOLS,
                                                           max_tokens=40, temperature=0)
            return first, second

    first, second = asyncio.run(conversation())
    # The call and its result are part of the second prompt, which holds the whole first one.
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 10
    message = second.choices[0].message
    assert message.content or message.tool_calls


def test_auto_with_a_response_format_answers_in_its_json_or_calls(client):
    answer = {"type": "object", "properties": {"summary": {"type": "string", "maxLength": 40}},
              "required": ["summary"], "additionalProperties": False}
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], tools=TOOLS, max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": answer}})
    c = r.choices[0]
    if c.message.tool_calls:
        assert c.finish_reason == "tool_calls"
        _check_calls(c.message)
    else:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), answer)


@pytest.mark.parametrize("body, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                             "required": "x"}}}]},
     "tools.0.function.parameters"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "structured_outputs": {"regex": "a+"}}, "structured_outputs.regex"),
])
def test_bad_tools_get_400_with_param(client, body, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, extra_body=body)
    assert info.value.body["param"] == param
