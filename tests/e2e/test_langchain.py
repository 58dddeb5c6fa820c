"""LangChain's `ChatOpenAI` against the real server, as an agent framework's first requests: `bind_tools` with a
forced and a required tool_choice (invoke and stream), a tool result fed back, and `with_structured_output` through
json_schema and function calling. Its HTTP goes through the official `openai` client."""
from __future__ import annotations

import json

import jsonschema
import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

MODEL = "smollm2-135m"


class GetWeather(BaseModel):
    """Current weather in a city."""

    city: str = Field(max_length=20)
    unit: str = Field(pattern="^(celsius|fahrenheit)$")


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=150)


@pytest.fixture(scope="module")
def llm(base_url: str) -> ChatOpenAI:
    return ChatOpenAI(model=MODEL, base_url=f"{base_url}/v1", api_key="unused", temperature=0, max_tokens=80,
                      max_retries=0, timeout=120)


def _valid_call(call: dict) -> None:
    assert call["name"] == "GetWeather" and call["id"].startswith("call_") and call["type"] == "tool_call"
    jsonschema.validate(call["args"], GetWeather.model_json_schema())
    GetWeather(**call["args"])


@pytest.mark.parametrize("tool_choice", ["GetWeather", "required", "any"])
def test_bind_tools_with_a_forced_choice_returns_a_valid_tool_call(llm: ChatOpenAI, tool_choice: str) -> None:
    msg = llm.bind_tools([GetWeather], tool_choice=tool_choice, parallel_tool_calls=False).invoke(
        "What is the weather in Paris?")
    assert isinstance(msg, AIMessage) and len(msg.tool_calls) == 1, msg
    assert not msg.invalid_tool_calls and msg.response_metadata["finish_reason"] == "tool_calls"
    _valid_call(msg.tool_calls[0])


def test_streamed_tool_call_chunks_add_up_to_the_same_call(llm: ChatOpenAI) -> None:
    bound = llm.bind_tools([GetWeather], tool_choice="GetWeather", parallel_tool_calls=False)
    whole = bound.invoke("Weather in Oslo?")
    chunks = list(bound.stream("Weather in Oslo?"))
    assert len(chunks) > 2  # the arguments arrive in pieces
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged = merged + chunk
    assert len(merged.tool_calls) == 1 and not merged.invalid_tool_calls
    _valid_call(merged.tool_calls[0])
    assert merged.tool_calls[0]["args"] == whole.tool_calls[0]["args"]  # greedy: streaming changes nothing


def test_a_tool_result_goes_back_and_the_model_answers(llm: ChatOpenAI) -> None:
    question = HumanMessage("What is the weather in Paris?")
    call = llm.bind_tools([GetWeather], tool_choice="GetWeather").invoke([question])
    result = ToolMessage(json.dumps({"temperature": 18, "sky": "clear"}), tool_call_id=call.tool_calls[0]["id"])
    answer = llm.bind_tools([GetWeather], tool_choice="none").invoke([question, call, result])
    assert not answer.tool_calls and isinstance(answer.content, str) and answer.content.strip()
    assert answer.response_metadata["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output_returns_the_pydantic_object(llm: ChatOpenAI, method: str) -> None:
    ask = "Invent a person. Answer in JSON with the fields name and age."
    structured = llm.with_structured_output(Person, method=method, include_raw=True)
    out = structured.invoke(ask)
    assert out["parsing_error"] is None, out
    assert isinstance(out["parsed"], Person), out
    assert 0 <= out["parsed"].age <= 150 and len(out["parsed"].name) <= 20


def test_json_mode_answers_a_json_object(llm: ChatOpenAI) -> None:
    """json_mode sends response_format json_object: any object, so only its being one is certain."""
    out = llm.with_structured_output(method="json_mode").invoke("Invent a person, as JSON with a name and an age.")
    assert isinstance(out, dict), out
