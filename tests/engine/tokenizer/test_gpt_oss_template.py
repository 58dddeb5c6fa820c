"""gpt-oss's own chat template (openai/gpt-oss-20b's chat_template.jinja, tests/data) in our sandboxed renderer.

References: the harmony format as OpenAI publishes it (the "OpenAI Harmony Response Format" guide's prompts, written
out below by hand), and transformers' own renderer of chat templates for everything the guide does not show
(earlier turns' thinking and calls, tool results, the efforts). And a harmony vocabulary's end tokens: <|return|>
and <|call|> end a generation, <|end|> (the end of each message) does not.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from engine.tokenizer.chat_template import ChatTemplate
from engine.tokenizer.tokenizer import Tokenizer
from engine.weights.gguf import read_gguf_metadata
from tests.support.tiny_models import GPT_OSS_TEMPLATE_PATH, build_tiny_model

TEMPLATE = GPT_OSS_TEMPLATE_PATH.read_text(encoding="utf-8")

# The guide's functions and its complete input with them (the section "Defining available tools").
GUIDE_TOOLS = [
    {"type": "function", "function": {"name": "get_location", "description": "Gets the location of the user."}},
    {"type": "function", "function": {
        "name": "get_current_weather", "description": "Gets the current weather in the provided location.",
        "parameters": {"type": "object", "properties": {
            "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"},
            "format": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"}},
            "required": ["location"]}}},
    {"type": "function", "function": {
        "name": "get_multiple_weathers", "description": "Gets the current weather in the provided list of locations.",
        "parameters": {"type": "object", "properties": {
            "locations": {"type": "array", "items": {"type": "string"},
                          "description": 'List of city and state, e.g. ["San Francisco, CA", "New York, NY"]'},
            "format": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"}},
            "required": ["locations"]}}},
]
GUIDE_PROMPT = """<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.
Knowledge cutoff: 2024-06
Current date: {date}

Reasoning: high

# Valid channels: analysis, commentary, final. Channel must be included for every message.
Calls to these tools must go to the commentary channel: 'functions'.<|end|><|start|>developer<|message|># Instructions

Use a friendly tone.

# Tools

## functions

namespace functions {{

// Gets the location of the user.
type get_location = () => any;

// Gets the current weather in the provided location.
type get_current_weather = (_: {{
// The city and state, e.g. San Francisco, CA
location: string,
format?: "celsius" | "fahrenheit", // default: celsius
}}) => any;

// Gets the current weather in the provided list of locations.
type get_multiple_weathers = (_: {{
// List of city and state, e.g. ["San Francisco, CA", "New York, NY"]
locations: string[],
format?: "celsius" | "fahrenheit", // default: celsius
}}) => any;

}} // namespace functions<|end|><|start|>user<|message|>What is the weather like in SF?<|end|><|start|>assistant"""
# The guide's basic system message (no functions), with a user turn after it (section "Chat conversation format").
GUIDE_BASIC = """<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.
Knowledge cutoff: 2024-06
Current date: {date}

Reasoning: {effort}

# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>\
<|start|>user<|message|>What is 2 + 2?<|end|><|start|>assistant"""


def render(messages: list[dict[str, Any]], **variables: Any) -> tuple[str, str]:
    """(ours, transformers') renders of the template, with the date of the day checked on both sides."""
    ours = ChatTemplate(TEMPLATE).render(messages, **variables)
    tools = variables.pop("tools", None)
    theirs = render_jinja_template([messages], tools=tools, chat_template=TEMPLATE, **variables)[0][0]
    return ours, theirs


def today() -> str:
    return datetime.now().strftime("%Y-%m-%d")


def test_the_guides_prompt_with_functions_and_instructions() -> None:
    messages = [{"role": "developer", "content": "Use a friendly tone."},
                {"role": "user", "content": "What is the weather like in SF?"}]
    ours, theirs = render(messages, tools=GUIDE_TOOLS, reasoning_effort="high", add_generation_prompt=True)
    # the template's one departure from the guide: it ends every parameter's line with ",\n", after an enum's
    # "// default: ..." comment too
    guide = GUIDE_PROMPT.format(date=today()).replace("// default: celsius\n", "// default: celsius,\n")
    assert ours == guide == theirs


@pytest.mark.parametrize("effort", ["low", "medium", "high", None])
def test_the_guides_basic_prompt_at_each_effort(effort: str | None) -> None:
    variables = {} if effort is None else {"reasoning_effort": effort}  # the template's default: medium
    ours, theirs = render([{"role": "user", "content": "What is 2 + 2?"}], add_generation_prompt=True, **variables)
    assert ours == GUIDE_BASIC.format(date=today(), effort=effort or "medium") == theirs


def test_earlier_turns_thinking_calls_and_results_as_transformers_renders_them() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "get_current_weather",
                                                         "arguments": {"location": "San Francisco"}}}
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4.", "thinking": "Simple arithmetic."},  # dropped: a final answer followed
        {"role": "user", "content": "And the weather in SF?"},
        {"role": "assistant", "content": "", "thinking": "Need to use function get_current_weather.",
         "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"sunny": true, "temperature": 20}'},
    ]
    ours, theirs = render(messages, tools=GUIDE_TOOLS, reasoning_effort="low", add_generation_prompt=True)
    assert ours == theirs
    # the guide's tool-call round trip: the call's thinking kept, the call with the recipient (in the role's part
    # of the header, which the guide allows) and its JSON, the result from the function to the assistant
    assert ours.endswith(
        "<|start|>user<|message|>And the weather in SF?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Need to use function get_current_weather.<|end|>"
        "<|start|>assistant to=functions.get_current_weather<|channel|>commentary json<|message|>"
        '{"location": "San Francisco"}<|call|>'
        "<|start|>functions.get_current_weather to=assistant<|channel|>commentary<|message|>"
        '"{\\"sunny\\": true, \\"temperature\\": 20}"<|end|><|start|>assistant')
    assert "Simple arithmetic." not in ours and "<|channel|>final<|message|>4.<|end|>" in ours
    # a training-style last turn (no generation prompt): its thinking, then the answer ended by <|return|>
    last = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!", "thinking": "Greet."}]
    ours, theirs = render(last, add_generation_prompt=False)
    assert ours == theirs and ours.endswith("<|start|>assistant<|channel|>analysis<|message|>Greet.<|end|>"
                                            "<|start|>assistant<|channel|>final<|message|>Hello!<|return|>")


@pytest.fixture(scope="module")
def harmony_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model("gpt_oss_harmony", tmp_path_factory.mktemp("harmony")).safetensors_dir


def gguf_metadata(model: Path) -> dict[str, Any]:
    """The tokenizer metadata llama.cpp writes into a gpt-oss GGUF (byte-level BPE, "gpt-4o" pre-tokenizer, special
    tokens as control tokens, EOS <|return|>), from the model's tokenizer.json: no list of end tokens there."""
    data = json.loads((model / "tokenizer.json").read_text(encoding="utf-8"))
    tokens = sorted(data["model"]["vocab"], key=data["model"]["vocab"].get)
    types = [1] * len(tokens)
    for added in data["added_tokens"]:
        types[added["id"]] = 3 if added["special"] else 4
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-4o", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]],
            "tokenizer.ggml.bos_token_id": tokens.index("<|startoftext|>"),
            "tokenizer.ggml.eos_token_id": tokens.index("<|return|>"), "tokenizer.chat_template": TEMPLATE}


def test_return_and_call_end_a_generation_and_end_does_not(harmony_model: Path) -> None:
    from_dir = Tokenizer.from_pretrained_dir(harmony_model)
    from_gguf = Tokenizer.from_gguf_metadata(gguf_metadata(harmony_model))
    # and the GGUF the tiny models' writer made of it, as llama.cpp's converter does
    written = Tokenizer.from_gguf_metadata(read_gguf_metadata(next(harmony_model.parent.glob("*.gguf"))))
    for tok in (from_dir, from_gguf, written):
        ends = {tok.id_to_token(i) for i in tok.end_token_ids}
        assert {"<|return|>", "<|call|>"} <= ends and "<|end|>" not in ends
    # and the template's own markers are single special tokens, the messages' text stays text
    ids = from_dir.apply_chat_template([{"role": "user", "content": "<|end|>hi"}])
    # the system message's and the user message's ends, not the user's text
    assert ids.count(from_dir.backend.token_to_id("<|end|>")) == 2
