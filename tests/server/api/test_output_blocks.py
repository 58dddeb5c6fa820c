"""Output blocks (the Responses and Messages answers' thinking, text runs and calls): for outputs built from known
thinking, text and calls, in each call format and cut into pieces anywhere, the blocks are that thinking, those text
runs and calls in the order written, and every block's deltas concatenate to its final text."""
from __future__ import annotations

import json

from hypothesis import given, settings, strategies as st

from server.api.output_blocks import BlockEvent, OutputBlocks, call_input
from server.api.openai.protocol import ToolDefinition
from server.api.openai.tool_calls import plan_tools

HERMES_TEMPLATE = "<tool_call>"  # a template that writes the marker: the hermes format
PLAIN_TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"  # no tool support: the generic format
TOOLS = [ToolDefinition.model_validate({"type": "function", "function": {"name": n, "parameters": {"type": "object"}}})
         for n in ("get_weather", "get_time")]

words = st.text(alphabet=st.sampled_from("abc xyz.!\n<>{}é"), min_size=0, max_size=20)
arguments = st.dictionaries(st.sampled_from(["city", "zone", "n"]), st.one_of(st.integers(-5, 99), words),
                            max_size=3)
calls = st.lists(st.tuples(st.sampled_from(["get_weather", "get_time"]), arguments), min_size=0, max_size=3)


def run(blocks: OutputBlocks, text: str, cuts: list[int]) -> list[BlockEvent]:
    """Feed `text` cut at `cuts`, then finish; every event."""
    events, last = [], 0
    for cut in sorted({c % (len(text) + 1) for c in cuts}) + [len(text)]:
        events += blocks.push(text[last:cut])
        last = cut
    return events + blocks.finish()


def check_events(blocks: OutputBlocks, events: list[BlockEvent]) -> None:
    """Each block opens once, gets its deltas, closes once, before the next one opens; deltas add up to its text."""
    opened = [e.index for e in events if e.kind == "open"]
    closed = [e.index for e in events if e.kind == "close"]
    assert opened == closed == list(range(len(blocks.blocks)))
    for i, block in enumerate(blocks.blocks):
        mine = [e for e in events if e.index == i]
        assert mine[0].kind == "open" and mine[-1].kind == "close"
        assert "".join(e.delta for e in mine if e.kind == "delta") == block.text
    assert [e.index for e in events] == sorted(e.index for e in events)  # no block opens before the last closed


@settings(max_examples=60, deadline=None)
@given(text=words, cuts=st.lists(st.integers(0, 40), max_size=5))
def test_plain_text_is_one_text_block(text, cuts):
    blocks = OutputBlocks(None)
    events = run(blocks, text, cuts)
    check_events(blocks, events)
    assert [(b.kind, b.text) for b in blocks.blocks] == [("text", text)]  # whitespace and empty text too


@settings(max_examples=60, deadline=None)
@given(before=words, made=calls, cuts=st.lists(st.integers(0, 400), max_size=8))
def test_hermes_text_then_calls(before, made, cuts):
    plan = plan_tools(TOOLS, "auto", None, HERMES_TEMPLATE)
    text = before + "".join(f'<tool_call>\n{{"name": "{n}", "arguments": {json.dumps(a)}}}\n</tool_call>'
                            for n, a in made)
    blocks = OutputBlocks(plan, new_id=iter(f"id{i}" for i in range(9)).__next__)
    events = run(blocks, text, cuts)
    check_events(blocks, events)
    expected = [("text", before, "")] if before.strip() or not made else []
    expected += [("call", json.dumps(a), n) for n, a in made]
    assert [(b.kind, b.text, b.name) for b in blocks.blocks] == expected
    assert [b.call_id for b in blocks.calls] == [f"id{i}" for i in range(len(made))]
    assert [call_input(b) for b in blocks.calls] == [a for _, a in made]
    assert blocks.text == (before if expected[:1] and expected[0][0] == "text" else "")


@settings(max_examples=40, deadline=None)
@given(made=calls, answer=words, cuts=st.lists(st.integers(0, 400), max_size=8))
def test_generic_envelopes(made, answer, cuts):
    plan = plan_tools(TOOLS, "auto", True, PLAIN_TEMPLATE)
    if made:
        text = json.dumps({"tool_calls": [{"name": n, "arguments": a} for n, a in made]})
        expected = [("call", json.dumps(a), n) for n, a in made]
    else:
        text = json.dumps({"response": answer})
        expected = [("text", answer, "")]
    blocks = OutputBlocks(plan)
    check_events(blocks, run(blocks, text, cuts))
    assert [(b.kind, b.text, b.name) for b in blocks.blocks] == expected


def test_a_call_cut_short_has_what_parsed_as_input_or_nothing():
    plan = plan_tools(TOOLS, "required", False, PLAIN_TEMPLATE)
    blocks = OutputBlocks(plan)
    blocks.push('{"tool_call": {"name": "get_time", "arguments": {"zone": "Eur')
    blocks.finish()
    [call] = blocks.blocks
    assert (call.kind, call.name, call.text) == ("call", "get_time", '{"zone": "Eur')
    assert call_input(call) == {}


@settings(max_examples=60, deadline=None)
@given(thinking=words, before=words, made=calls, cuts=st.lists(st.integers(0, 400), max_size=8),
       thinking_cuts=st.lists(st.integers(0, 40), max_size=4))
def test_thinking_is_a_block_before_the_answers(thinking, before, made, cuts, thinking_cuts):
    """The thinking, however it arrives, is one reasoning block first; the answer's blocks follow as without it."""
    plan = plan_tools(TOOLS, "auto", None, HERMES_TEMPLATE)
    text = before + "".join(f'<tool_call>\n{{"name": "{n}", "arguments": {json.dumps(a)}}}\n</tool_call>'
                            for n, a in made)
    blocks = OutputBlocks(plan, new_id=iter(f"id{i}" for i in range(9)).__next__)
    events, last = [], 0
    for cut in sorted({c % (len(thinking) + 1) for c in thinking_cuts}) + [len(thinking)]:
        events += blocks.push("", thinking[last:cut])
        last = cut
    events += run(blocks, text, cuts)
    check_events(blocks, events)
    answer = [("text", before)] if before.strip() or not made else []
    answer += [("call", json.dumps(a)) for _, a in made]
    expected = ([("reasoning", thinking)] if thinking else []) + answer
    assert [(b.kind, b.text) for b in blocks.blocks] == expected
    assert blocks.reasoning == thinking


def test_thinking_alone_still_has_an_empty_answer():
    """An output cut while thinking (max_tokens) answers its thinking and an empty text, as chat's empty content."""
    blocks = OutputBlocks(None)
    events = blocks.push("", "so far") + blocks.finish()
    check_events(blocks, events)
    assert [(b.kind, b.text) for b in blocks.blocks] == [("reasoning", "so far"), ("text", "")]
