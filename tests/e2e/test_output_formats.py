"""Structured outputs on the real server with the official client: parse() with a pydantic model, json_schema,
json_object, vLLM's structured_outputs on completions, and 400s naming the field."""
from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

MODEL = "smollm2-135m"
ASK = [{"role": "user", "content": "Describe a person as JSON."}]


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)
    hobbies: list[str] = Field(max_length=3)


def test_parse_returns_the_pydantic_object(client):
    r = client.chat.completions.parse(model=MODEL, messages=ASK, response_format=Person, max_tokens=80,
                                      temperature=0)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(r.choices[0].message.parsed, Person)


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                      "rank": {"type": "integer", "minimum": 1, "maximum": 5}},
     "required": ["city", "rank"], "additionalProperties": False},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green"]}, "zip": {"type": "string",
                                                                                   "pattern": "^[0-9]{5}$"}},
     "required": ["colour", "zip"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
])
def test_json_schema_outputs_validate(client, schema):
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=60, n=2, temperature=1.0, seed=7,
        response_format={"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}})
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_parses_streamed_too(client):
    stream = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=48, stream=True, temperature=0,
                                            response_format={"type": "json_object"})
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert text.startswith("{") and "\n" not in text
    if finish == "stop":
        assert isinstance(json.loads(text), dict)


def test_completions_take_structured_outputs(client):
    r = client.completions.create(model=MODEL, prompt="The answer is", max_tokens=12, n=3, temperature=1.0, seed=1,
                                  extra_body={"structured_outputs": {"regex": r" (yes|no), [0-9]{2}"}})
    for choice in r.choices:
        assert re.fullmatch(r" (yes|no), [0-9]{2}", choice.text) and choice.finish_reason == "stop"
    r = client.completions.create(model=MODEL, prompt="Pick:", max_tokens=8,
                                  extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}})
    assert r.choices[0].text in ("alpha", "beta")


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "dependentSchemas": {"a": {}}}}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs.grammar"),
])
def test_bad_constraints_get_400_with_param(client, body, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, extra_body=body)
    assert info.value.body["param"] == param
