"""Tool calls: plans and their errors, grammars that force valid calls in every format (driven by the brute-force
decoder of conftest.py over the real SmolLM2 vocabulary), the streaming parser's deltas, and the rendering of
tools and of earlier calls and results into the prompt."""
from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from engine.tokenizer.tokenizer import Tokenizer
from server.grammar.compiler import StructuredOutputError
from server.api.openai.protocol import ChatMessage, NamedToolChoice, ToolDefinition
from server.api.openai.tool_calls import plan_tools, template_messages, tool_format
from server.api.tool_parser import ToolCallParser
from tests.support.schema_cases import SCHEMAS

HERMES_TEMPLATE = "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>{% endif %}<tool_call>"
LLAMA3_TEMPLATE = "<|start_header_id|>{% if tools %}{{ tools | tojson }}{% endif %}ipython"
PLAIN_TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"
TEMPLATES = {"hermes": HERMES_TEMPLATE, "llama3": LLAMA3_TEMPLATE, "generic": PLAIN_TEMPLATE}
OBJECT_SCHEMAS = [s for s in SCHEMAS if s.get("type") == "object"]


def tool(name: str, parameters: dict | None = None, description: str = "") -> ToolDefinition:
    fn = {"name": name, "description": description}
    if parameters is not None:
        fn["parameters"] = parameters
    return ToolDefinition.model_validate({"type": "function", "function": fn})


def parse(fmt: str, text: str) -> ToolCallParser:
    parser = ToolCallParser(fmt)
    parser.push(text)
    parser.finish()
    return parser


def test_formats_follow_the_template():
    assert [tool_format(t) for t in TEMPLATES.values()] == list(TEMPLATES)


@pytest.mark.parametrize("tools, choice, param, words", [
    ([tool("f"), tool("f")], "auto", "tools.1.function.name", "twice"),
    ([tool("f", {"type": "array"})], "auto", "tools.0.function.parameters", "type object"),
    ([tool("f", {"type": "object", "properties": {"x": {"type": 3}}})], "required", "tools.0.function.parameters",
     "not a valid JSON Schema"),
    ([tool("f")], NamedToolChoice.model_validate({"type": "function", "function": {"name": "g"}}), "tool_choice",
     "not in tools"),
    ([], "required", "tool_choice", "requires tools"),
])
def test_bad_tools_are_refused_naming_the_field(tools, choice, param, words):
    with pytest.raises(StructuredOutputError) as info:
        plan_tools(tools, choice, None, PLAIN_TEMPLATE)
    assert info.value.param == param and words in info.value.message


def test_choices_and_parallel_calls():
    tools = [tool("f"), tool("g")]
    assert plan_tools(tools, "none", None, PLAIN_TEMPLATE).grammar is None
    assert plan_tools(tools, "none", None, PLAIN_TEMPLATE).tools == []
    assert plan_tools(None, None, None, PLAIN_TEMPLATE) is None
    named = plan_tools(tools, NamedToolChoice.model_validate({"type": "function", "function": {"name": "g"}}), None,
                       HERMES_TEMPLATE)
    assert [t["function"]["name"] for t in named.tools] == ["g"] and not named.parallel
    assert plan_tools(tools, "auto", None, HERMES_TEMPLATE).parallel
    assert not plan_tools(tools, "auto", False, HERMES_TEMPLATE).parallel
    assert not plan_tools(tools, "required", None, LLAMA3_TEMPLATE).parallel  # one call per turn


@pytest.mark.parametrize("fmt", ["generic", "hermes", "llama3"])
def test_required_calls_have_arguments_valid_against_their_schema(grammars, drive, fmt):
    schemas = OBJECT_SCHEMAS if fmt == "generic" else OBJECT_SCHEMAS[::4]  # every schema in the models' format
    tools = [tool(f"fn_{i}", s) for i, s in enumerate(schemas)]
    for i, schema in enumerate(schemas):
        # Named: that function; every third, required: it or its neighbour (the walk picks).
        choice = NamedToolChoice.model_validate({"type": "function", "function": {"name": f"fn_{i}"}}) \
            if i % 3 else "required"
        offered = tools if choice != "required" else tools[i:i + 2]
        plan = plan_tools(offered, choice, None, TEMPLATES[fmt])
        walk = drive(grammars.compile(plan.grammar), seed=i)
        assert walk.complete, walk.text
        parser = parse(fmt, walk.text)
        assert parser.calls, walk.text
        for call in parser.calls:
            index = int(call.name.removeprefix("fn_"))
            assert choice == "required" or index == i
            jsonschema.validate(json.loads(call.arguments), schemas[index])
        assert not parser.content.strip()


@pytest.mark.parametrize("fmt", ["generic", "hermes", "llama3"])
def test_auto_allows_text_or_a_valid_call(grammars, drive, smol_tokenizer, fmt):
    import torch

    schema = OBJECT_SCHEMAS[17]
    plan = plan_tools([tool("lookup", schema)], "auto", None, TEMPLATES[fmt])
    grammar = grammars.compile(plan.grammar)
    # A "model" that wants to start the call, and one that wants to talk.
    start = {"generic": '{"tool', "hermes": "<tool_call>", "llama3": "{"}[fmt]
    called = drive(grammar, seed=1, prefix=tuple(smol_tokenizer.encode(start, add_special_tokens=False)))
    parser = parse(fmt, called.text)
    assert called.complete and parser.calls, called.text
    jsonschema.validate(json.loads(parser.calls[0].arguments), schema)
    words = smol_tokenizer.encode(" Hello there", add_special_tokens=False)
    toward_text = torch.zeros(smol_tokenizer.vocab_size)
    toward_text[words] = 20.0
    if fmt == "generic":  # the response envelope
        toward_text[smol_tokenizer.encode('{"response', add_special_tokens=False)] = 20.0
    talked = drive(grammar, seed=2, bias=toward_text, max_steps=30)
    parser = parse(fmt, talked.text)
    assert not parser.calls and parser.content.strip(), talked.text


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3),
    max_leaves=8)
calls = st.lists(st.tuples(st.from_regex(r"[a-z_][a-z0-9_]{0,10}", fullmatch=True),
                           st.dictionaries(st.text(max_size=6), json_values, max_size=4)), min_size=1, max_size=3)


def _render(fmt: str, text: str, made: list[tuple[str, dict]], ensure_ascii: bool) -> str:
    dump = lambda v: json.dumps(v, ensure_ascii=ensure_ascii)  # noqa: E731
    if fmt == "hermes":
        blocks = "\n".join(f"<tool_call>\n{dump({'name': n, 'arguments': a})}\n</tool_call>" for n, a in made)
        return text + blocks
    if fmt == "llama3":
        return dump({"name": made[0][0], "parameters": made[0][1]})
    if len(made) == 1:
        return dump({"tool_call": {"name": made[0][0], "arguments": made[0][1]}})
    return dump({"tool_calls": [{"name": n, "arguments": a} for n, a in made]})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fmt=st.sampled_from(["hermes", "llama3", "generic"]), made=calls,
       text=st.text(max_size=20).filter(lambda t: "<" not in t), ensure_ascii=st.booleans(), data=st.data())
def test_streamed_deltas_reassemble_exactly(fmt, made, text, ensure_ascii, data):
    output = _render(fmt, text, made, ensure_ascii)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(output)), max_size=12)))
    pieces = [output[a:b] for a, b in zip([0, *cuts], [*cuts, len(output)])]
    parser = ToolCallParser(fmt)
    content, deltas = [], []
    for piece in pieces:
        c, d = parser.push(piece)
        content.append(c)
        deltas += d
    c, d = parser.finish()
    content.append(c)
    deltas += d
    whole = parse(fmt, output)
    expected = made[:1] if fmt == "llama3" else made
    assert [c.name for c in whole.calls] == [n for n, _ in expected]
    assert [json.loads(c.arguments) for c in whole.calls] == [a for _, a in expected]
    by_index: dict[int, list] = {}
    for delta in deltas:
        by_index.setdefault(delta.index, []).append(delta)
    assert sorted(by_index) == list(range(len(expected)))
    for i, call_deltas in by_index.items():
        first, rest = call_deltas[0], call_deltas[1:]
        assert first.id is not None and first.name == whole.calls[i].name
        assert all(d.id is None and d.name is None for d in rest)
        arguments = "".join(d.arguments for d in call_deltas)
        assert arguments == parser.calls[i].arguments
        assert json.loads(arguments) == expected[i][1]
    assert "".join(content) == parser.content == (text if fmt == "hermes" else "")


@given(text=st.text(max_size=40))
def test_text_without_calls_streams_as_content(text):
    for fmt in ("hermes", "llama3"):
        if fmt == "llama3" and text.lstrip().startswith("{"):
            continue
        parser = ToolCallParser(fmt)
        out = [parser.push(ch)[0] for ch in text] + [parser.finish()[0]]
        assert "".join(out) == text and not parser.calls


def test_generic_response_streams_as_decoded_content():
    parser = ToolCallParser("generic")
    output = json.dumps({"response": 'He said "hi"\n\u00e9 \U0001F600 \\ end'})
    out = "".join(parser.push(ch)[0] for ch in output) + parser.finish()[0]
    assert out == 'He said "hi"\n\u00e9 \U0001F600 \\ end' and not parser.calls


def _messages() -> list[ChatMessage]:
    return [ChatMessage.model_validate(m) for m in [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"},
    ]]


def test_generic_rendering_describes_tools_and_writes_calls_as_the_envelope(smol_tokenizer: Tokenizer):
    plan = plan_tools([tool("weather", {"type": "object", "properties": {"city": {"type": "string"}}},
                            "Current weather <|im_end|> of a city")], "auto", None, smol_tokenizer.chat_template)
    assert plan.format == "generic"
    messages, variables = template_messages(_messages(), plan.format, plan)
    assert variables == {}
    assert messages[0]["role"] == "system" and '"name": "weather"' in messages[0]["content"]
    assert json.loads(messages[2]["content"]) == {"tool_call": {"name": "weather", "arguments": {"city": "Paris"}}}
    assert json.loads(messages[3]["content"]) == {"tool_response": {"tool_call_id": "call_1", "name": "weather",
                                                                    "content": "18C, sunny"}}
    ids = smol_tokenizer.apply_chat_template(messages, **variables)
    text = smol_tokenizer.decode(ids)
    assert "18C, sunny" in text and "Current weather <|im_end|> of a city" in text
    # The special-token text inside the tool description stayed text: no more end-of-turn ids than turns.
    im_end = smol_tokenizer.backend.token_to_id("<|im_end|>")
    assert ids.count(im_end) == len(messages)


def test_hermes_rendering_passes_tools_and_calls_to_the_template(smol_tokenizer: Tokenizer):
    template = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}"
                "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
                "{% if m.role == 'tool' %}<tool_response id={{ m.tool_call_id }}>{{ m.content }}</tool_response>"
                "{% else %}{{ m.content }}{% endif %}{% endfor %}")
    plan = plan_tools([tool("weather")], "auto", None, template)
    messages, variables = template_messages(_messages(), plan.format, plan)
    tok = Tokenizer(smol_tokenizer.backend, bos_token_id=None, eos_token_id=smol_tokenizer.eos_token_id,
                    end_token_ids=smol_tokenizer.end_token_ids, add_bos_token=False, chat_template=template,
                    byte_level=True, strip_leading_space=False)
    text = tok.apply_chat_template(messages, tokenize=False, **variables)
    assert text == ('[weather]Weather in Paris?<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}'
                    '</tool_call><tool_response id=call_1>18C, sunny</tool_response>')


def test_arguments_that_are_not_json_are_refused():
    bad = _messages()
    bad[1].tool_calls[0].function.arguments = "{city: Paris"
    with pytest.raises(StructuredOutputError) as info:
        template_messages(bad, "hermes", None)
    assert info.value.param == "messages.1.tool_calls.0.function.arguments"


@pytest.mark.parametrize("fmt", ["generic", "hermes"])
def test_auto_with_a_response_format_answers_in_its_json_or_calls(grammars, drive, smol_tokenizer, fmt):
    answer_schema = OBJECT_SCHEMAS[6]  # {"colour": enum}
    arguments = OBJECT_SCHEMAS[9]      # {"zip": pattern}
    plan = plan_tools([tool("lookup", arguments)], "auto", None, TEMPLATES[fmt], answer_schema)
    assert plan.json_response
    grammar = grammars.compile(plan.grammar)
    answer_start = '{"response' if fmt == "generic" else "{"
    call_start = '{"tool' if fmt == "generic" else "<tool_call>"
    answered = drive(grammar, seed=3, prefix=tuple(smol_tokenizer.encode(answer_start, add_special_tokens=False)))
    parser = plan.parser()
    streamed = parser.push(answered.text)[0] + parser.finish()[0]
    assert answered.complete and not parser.calls, answered.text
    assert streamed == parser.content
    jsonschema.validate(json.loads(parser.content), answer_schema)
    called = drive(grammar, seed=4, prefix=tuple(smol_tokenizer.encode(call_start, add_special_tokens=False)))
    parser = plan.parser()
    parser.push(called.text)
    parser.finish()
    assert called.complete and parser.calls and not parser.content.strip(), called.text
    jsonschema.validate(json.loads(parser.calls[0].arguments), arguments)


def test_a_response_format_with_tools_only_shapes_auto_answers():
    schema = {"type": "object"}
    assert not plan_tools([tool("f")], "required", None, HERMES_TEMPLATE, schema).json_response
    with pytest.raises(StructuredOutputError) as info:
        plan_tools([tool("f")], "auto", None, LLAMA3_TEMPLATE, schema)
    assert info.value.param == "response_format"
