"""Harmony tool calls (gpt-oss) on the tiny harmony model's vocabulary and template: the format found from the
template, what the plans are, a forced call's grammar walked by random "models" and its output read back by the
harmony splitter and call parser as a valid call, and the conversation as gpt-oss's template gets it."""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch

from engine.tokenizer.chat_template import ChatTemplate
from engine.tokenizer.tokenizer import Tokenizer
from server.api.openai.protocol import ChatMessage, NamedToolChoice, ToolDefinition
from server.api.openai.tool_calls import plan_tools, template_messages, tool_format
from server.grammar.compiler import GrammarCompiler
from server.grammar.token_bitmask import allocate_bitmask, apply_token_bitmask
from server.reasoning.formats import REASONING_FORMATS
from server.reasoning.harmony import HarmonySplitter
from server.reasoning.plan import make_plan
from server.reasoning.splitter import Split
from tests.support.schema_cases import SCHEMAS
from tests.support.tiny_models import GPT_OSS_TEMPLATE_PATH, build_tiny_model

TEMPLATE = GPT_OSS_TEMPLATE_PATH.read_text(encoding="utf-8")
OBJECT_SCHEMAS = [s for s in SCHEMAS if s.get("type") == "object"]


def tool(name: str, parameters: dict | None = None) -> ToolDefinition:
    fn = {"name": name} if parameters is None else {"name": name, "parameters": parameters}
    return ToolDefinition.model_validate({"type": "function", "function": fn})


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    model = build_tiny_model("gpt_oss_harmony", tmp_path_factory.mktemp("harmony")).safetensors_dir
    return Tokenizer.from_pretrained_dir(Path(model))


def test_gpt_oss_template_is_the_harmony_format_and_calls_one_at_a_time() -> None:
    assert tool_format(TEMPLATE) == "harmony"
    tools = [tool("f"), tool("g")]
    auto = plan_tools(tools, "auto", None, TEMPLATE)
    assert auto.grammar is None and not auto.parallel  # <|call|> ends the output: one call per turn
    assert plan_tools(tools, "required", None, TEMPLATE).grammar.kind == "lark"
    # with a response format, auto answers are held to it by the reasoning gate, not by a tools grammar
    assert plan_tools(tools, "auto", None, TEMPLATE, {"type": "object"}).grammar is None


def walk(tokenizer: Tokenizer, grammar, seed: int, end_bias: float) -> list[int]:
    """A random "model" under the grammar (greedy over random logits); `end_bias` on <|end|>, for a thinking
    message that ends, and a bias toward tokens that close strings and containers, for arguments that end."""
    gen = torch.Generator().manual_seed(seed)
    matcher, bitmask = grammar.matcher(), allocate_bitmask(1, tokenizer.vocab_size)
    bias = torch.tensor([[5.0 if any(c in tokenizer.token_bytes(i) for c in b'"}]),') else 0.0
                          for i in range(tokenizer.vocab_size)]])
    bias[0, tokenizer.backend.token_to_id("<|end|>")] += end_bias
    tokens: list[int] = []
    while not matcher.is_stopped and len(tokens) < 300:
        matcher.fill_bitmask(bitmask, 0)
        logits = torch.randn(1, tokenizer.vocab_size, generator=gen) + bias
        apply_token_bitmask(logits, bitmask)
        tokens.append(int(logits.argmax()))
        assert matcher.advance(tokens[-1]), matcher.error
    assert matcher.is_stopped, tokenizer.decode(tokens)
    return tokens


@pytest.mark.parametrize("end_bias", [7.0, 20.0])
def test_a_forced_call_is_a_valid_call_with_or_without_thinking_first(tokenizer: Tokenizer, end_bias: float) -> None:
    schemas = OBJECT_SCHEMAS[::3]
    tools = [tool(f"fn_{i}", s) for i, s in enumerate(schemas)]
    grammars = GrammarCompiler(tokenizer)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    for i, schema in enumerate(schemas):
        choice = NamedToolChoice.model_validate({"type": "function", "function": {"name": f"fn_{i}"}}) \
            if i % 2 else "required"
        plan = plan_tools(tools, choice, None, TEMPLATE)
        output = walk(tokenizer, grammars.compile(plan.grammar), seed=i, end_bias=end_bias)
        assert output[-1] == tokenizer.backend.token_to_id("<|call|>") and output[-1] in tokenizer.end_token_ids
        # read back as the server reads it: the splitter over the detokenized tokens, then the call parser
        reasoning = make_plan(REASONING_FORMATS["harmony"], prompt,
                              lambda t: tokenizer.encode(t, add_special_tokens=False), tokenizer.decode, None,
                              calls=True)
        splitter, split = HarmonySplitter(reasoning), Split()
        detokenize = tokenizer.detokenizer(skip_special_tokens=True)
        for token in output:
            split += splitter.push(token, detokenize.push(token))
        parser = plan.parser()
        parser.push(split.answer)
        parser.finish()
        assert parser.content == "" and len(parser.calls) == 1, tokenizer.decode(output)
        index = int(parser.calls[0].name.removeprefix("fn_"))
        assert choice == "required" or index == i
        jsonschema.validate(json.loads(parser.calls[0].arguments), schemas[index])


def test_the_template_gets_thinking_and_one_call_per_message_each_result_after_its_call() -> None:
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": name, "arguments": json.dumps({"x": i})}}
             for i, name in enumerate(["f", "g"])]
    messages = [ChatMessage.model_validate(m) for m in [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None, "reasoning_content": "Two calls.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "G"},  # results in another order than the calls
        {"role": "tool", "tool_call_id": "c0", "content": "F"},
    ]]
    plan = plan_tools([tool("f"), tool("g")], "auto", None, TEMPLATE)
    conversation, variables = template_messages(messages, "harmony", plan)
    assert [(m["role"], m.get("thinking"), [c["function"]["name"] for c in m.get("tool_calls", [])],
             m.get("content")) for m in conversation] == [
        ("user", None, [], "Hi"), ("assistant", "Two calls.", ["f"], ""), ("tool", None, [], "F"),
        ("assistant", None, ["g"], ""), ("tool", None, [], "G")]
    assert [t["function"]["description"] for t in variables["tools"]] == ["", ""]  # the template needs one
    rendered = ChatTemplate(TEMPLATE).render(conversation, **variables)
    assert ('<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{"x": 0}<|call|>'
            '<|start|>functions.f to=assistant<|channel|>commentary<|message|>"F"<|end|>'
            '<|start|>assistant to=functions.g<|channel|>commentary json<|message|>{"x": 1}<|call|>'
            '<|start|>functions.g to=assistant<|channel|>commentary<|message|>"G"<|end|>') in rendered
    assert "<|channel|>analysis<|message|>Two calls.<|end|>" in rendered
