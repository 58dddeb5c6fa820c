"""The harmony splitter against the format's rule applied to the whole output at once (gpt-oss's harmony docs: a
message is `<|start|>{header}<|message|>{text}` ended by `<|end|>`, `<|call|>` or `<|return|>`): however the output's
text is cut into tokens, the thinking, the answer and the calls come out the same, and no header or control token
leaks into them. The vocabulary here is a stand-in: the control tokens are ids 0..6, any other piece of text a token
of its own, numbered as it is first seen."""
from __future__ import annotations

import re

from hypothesis import given, settings, strategies as st

from server.api.harmony_calls import HarmonyCallParser
from server.reasoning.formats import HARMONY_TOKENS, REASONING_FORMATS
from server.reasoning.gate import ReasoningGate
from server.reasoning.harmony import HarmonySplitter, new_splitter
from server.reasoning.plan import Phase, ReasoningPlan, make_plan
from server.reasoning.splitter import Split

HARMONY = REASONING_FORMATS["harmony"]
CONTROL = {t: i for i, t in enumerate(HARMONY_TOKENS)}
START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL = HARMONY_TOKENS
_SPLIT = re.compile("(" + "|".join(re.escape(t) for t in HARMONY_TOKENS) + ")")
PIECES: dict[str, int] = {}  # text tokens, by their text


def piece_id(text: str) -> int:
    return PIECES.setdefault(text, 1000 + len(PIECES))


def token_text(token: int) -> str:
    """A token's text as the detokenizer gives it (a control token's: "")."""
    return "" if token < len(HARMONY_TOKENS) else next(t for t, i in PIECES.items() if i == token)


def tokens(text: str, cuts: list[int] = ()) -> list[tuple[int, str]]:
    """(id, text) of `text`: its control tokens, and the text between them cut at `cuts` (offsets into each
    stretch); a control token's text is "" as the server's detokenizer (special tokens skipped) gives it."""
    out = []
    for part in _SPLIT.split(text):
        if part in CONTROL:
            out.append((CONTROL[part], ""))
        elif part:
            points = sorted({c % len(part) for c in cuts} | {0, len(part)})
            out += [(piece_id(part[a:b]), part[a:b]) for a, b in zip(points, points[1:])]
    return out


def encode(text: str) -> list[int]:
    return [i for i, _ in tokens(text)]


def decode(ids: list[int]) -> str:
    return "".join(HARMONY_TOKENS[i] if i < len(HARMONY_TOKENS) else token_text(i) for i in ids)


def plan_after(prompt: str, *, calls: bool = False, budget: int | None = None) -> ReasoningPlan:
    return make_plan(HARMONY, encode(prompt), encode, decode, budget, calls=calls)


GENERATION_PROMPT = f"{START}user{MESSAGE}Hi{END}{START}assistant"


def reference(output: str) -> list[tuple[str, str, str]]:
    """The messages of a whole output after the generation prompt, in order, as (route, name, text) by the format's
    rule: analysis or a built-in tool's text is "thinking", final or a commentary preamble "answer", a message to
    functions.NAME a "call" of NAME with its text as arguments."""
    out = []
    for message in (f"{START}assistant" + output).split(START)[1:]:
        header, sep, rest = message.partition(MESSAGE)
        if not sep:
            continue
        text = re.split("|".join(re.escape(t) for t in (END, CALL, RETURN, CHANNEL, CONSTRAIN, MESSAGE)), rest)[0]
        recipient = re.search(r"to=(\S+?)(?=\s|<\||$)", header)
        channel = re.search(r"<\|channel\|>\s*(\w+)", header)
        if recipient and recipient.group(1).startswith("functions."):
            out.append(("call", recipient.group(1).removeprefix("functions."), text))
        elif recipient or (channel and channel.group(1) == "analysis"):
            out.append(("thinking", "", text))
        else:
            out.append(("answer", "", text))
    return out


def texts(messages: list[tuple[str, str, str]], *routes: str) -> str:
    return "".join(text for route, _, text in messages if route in routes)


def split(plan: ReasoningPlan, output: str, cuts: list[int] = ()) -> tuple[Split, HarmonySplitter]:
    splitter, out = HarmonySplitter(plan), Split()
    for token, text in tokens(output, cuts):
        out += splitter.push(token, text)
    out += splitter.finish()
    return out, splitter


def parse_calls(answer: str, cuts: list[int]) -> tuple[str, list[tuple[str, str]], list]:
    """The answer through the call parser, fed in pieces cut at `cuts`: (content, calls, deltas)."""
    parser, content, deltas = HarmonyCallParser(), "", []
    points = sorted({c % (len(answer) + 1) for c in cuts} | {0, len(answer)})
    for a, b in zip(points, points[1:]):
        text, more = parser.push(answer[a:b])
        content, deltas = content + text, deltas + more
    text, more = parser.finish()
    return content + text, [(c.name, c.arguments) for c in parser.calls], deltas + more


# ---- random outputs ----

WORDS = st.sampled_from(["a", "b c", " ", "\n", "{", "}", '"x": 1', "<", "|", "to", "=", "final", "json"])
BODY = st.lists(WORDS, max_size=6).map("".join)
NAME = st.sampled_from(["get_weather", "f", "lookup_2"])


@st.composite
def message(draw) -> str:
    """One message's header and text, as gpt-oss writes them (its `<|start|>assistant` and end left out)."""
    kind = draw(st.sampled_from(["analysis", "final", "preamble", "call", "call_in_role", "builtin"]))
    body = draw(BODY)
    name = draw(NAME)
    constrain = draw(st.sampled_from([f" {CONSTRAIN}json", " json", ""]))
    return {"analysis": f"{CHANNEL}analysis{MESSAGE}{body}",
            "final": f"{CHANNEL}final{MESSAGE}{body}",
            "preamble": f"{CHANNEL}commentary{MESSAGE}{body}",
            "call": f"{CHANNEL}commentary to=functions.{name}{constrain}{MESSAGE}{body}",
            "call_in_role": f" to=functions.{name}{CHANNEL}commentary{constrain}{MESSAGE}{body}",
            "builtin": f"{CHANNEL}analysis to=python{MESSAGE}{body}"}[kind]


@st.composite
def outputs(draw) -> str:
    """Messages, each but the last ended by <|end|> and the next opened by <|start|>assistant; the last ended by
    <|return|>, <|call|>, <|end|> or cut off."""
    messages = draw(st.lists(message(), min_size=1, max_size=4))
    last = draw(st.sampled_from([RETURN, CALL, END, ""]))
    return f"{END}{START}assistant".join(messages) + last


@settings(max_examples=400, deadline=None)
@given(outputs(), st.lists(st.integers(0, 40), max_size=6), st.booleans())
def test_any_cutting_gives_the_whole_outputs_messages(output: str, cuts: list[int], calls: bool) -> None:
    messages = reference(output)
    out, _ = split(plan_after(GENERATION_PROMPT, calls=calls), output, cuts)
    assert out.reasoning == texts(messages, "thinking")
    if not calls:  # a call's arguments are answer text
        assert out.answer == texts(messages, "answer", "call")
        return
    content, parsed, deltas = parse_calls(out.answer, cuts)
    assert content == texts(messages, "answer")
    assert parsed == [(name, text) for route, name, text in messages if route == "call"]
    # the deltas stream each call: its id and name first, then fragments adding up to its arguments
    for index, (name, arguments) in enumerate(parsed):
        mine = [d for d in deltas if d.index == index]
        assert mine[0].name == name and mine[0].id is not None and all(d.id is None for d in mine[1:])
        assert "".join(d.arguments for d in mine) == arguments


# ---- the cases by name ----

def test_the_published_example_splits_into_its_thinking_and_answer() -> None:
    # gpt-oss's harmony docs' example output for "What is 2 + 2?"
    output = (f'{CHANNEL}analysis{MESSAGE}User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.{END}'
              f"{START}assistant{CHANNEL}final{MESSAGE}2 + 2 = 4.{RETURN}")
    out, splitter = split(plan_after(GENERATION_PROMPT), output, [3, 11])
    assert out.reasoning == 'User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.'
    assert out.answer == "2 + 2 = 4."
    assert splitter.phase is Phase.ANSWER


def test_without_a_final_message_all_is_thinking_and_the_answer_is_empty() -> None:
    out, splitter = split(plan_after(GENERATION_PROMPT), f"{CHANNEL}analysis{MESSAGE}Still thinking about it")
    assert (out.reasoning, out.answer) == ("Still thinking about it", "")
    assert splitter.phase is Phase.THINKING


def test_the_published_call_and_one_without_constrain_are_calls() -> None:
    # the docs' call (the recipient in the channel's part, <|constrain|>json), and the template's own way of writing
    # one (the recipient before the channel, a bare json)
    published = (f"{CHANNEL}analysis{MESSAGE}Need to use function get_weather.{END}{START}assistant{CHANNEL}"
                 f'commentary to=functions.get_weather {CONSTRAIN}json{MESSAGE}{{"location":"San Francisco"}}{CALL}')
    in_role = f' to=functions.get_weather{CHANNEL}commentary json{MESSAGE}{{"location": "Tokyo"}}{CALL}'
    for output, arguments in ((published, '{"location":"San Francisco"}'), (in_role, '{"location": "Tokyo"}')):
        out, _ = split(plan_after(GENERATION_PROMPT, calls=True), output, [5])
        content, calls, _ = parse_calls(out.answer, [7, 30])
        assert (content, calls) == ("", [("get_weather", arguments)])


def test_several_calls_in_one_output_are_each_parsed() -> None:
    # <|call|> ends a generation; an output that goes on past it (ignore_eos) still parses call by call
    output = (f'{CHANNEL}commentary to=functions.a {CONSTRAIN}json{MESSAGE}{{"x": 1}}{CALL}{START}assistant'
              f'{CHANNEL}commentary{MESSAGE}and then{END}{START}assistant{CHANNEL}commentary to=functions.b json'
              f'{MESSAGE}{{}}{CALL}')
    out, _ = split(plan_after(GENERATION_PROMPT, calls=True), output, [1, 2])
    content, calls, deltas = parse_calls(out.answer, [1, 9, 44])
    assert content == "and then" and calls == [("a", '{"x": 1}'), ("b", "{}")]
    assert [d.name for d in deltas if d.id is not None] == ["a", "b"]


def test_a_prompt_that_opened_the_analysis_starts_in_the_thinking() -> None:
    plan = plan_after(f"{GENERATION_PROMPT}{CHANNEL}analysis{MESSAGE}")
    assert plan.opened == f"assistant{CHANNEL}analysis{MESSAGE}"
    out, _ = split(plan, f"hmm{END}{START}assistant{CHANNEL}final{MESSAGE}ok{RETURN}")
    assert (out.reasoning, out.answer) == ("hmm", "ok")
    # after a closed message, nothing is open: the output starts with a message of its own
    assert plan_after(f"{START}user{MESSAGE}Hi{END}").opened == ""


def test_thinking_tokens_are_the_analysis_messages() -> None:
    analysis = f"{CHANNEL}analysis{MESSAGE}a b c{END}"
    out, splitter = split(plan_after(GENERATION_PROMPT), f"{analysis}{START}assistant{CHANNEL}final{MESSAGE}x",
                          [1, 2, 3])
    assert splitter.reasoning_tokens == len(tokens(analysis, [1, 2, 3]))


def test_a_spent_budget_forces_the_final_channel() -> None:
    plan = plan_after(GENERATION_PROMPT, budget=3)  # the analysis message's header, then forcing
    assert decode(list(plan.end_ids)) == END + HARMONY.end
    gate = ReasoningGate(plan, None, 2000, token_text)
    for token, _ in tokens(f"{CHANNEL}analysis{MESSAGE}"):
        assert gate.advance(token)
    forced = []
    for _ in range(len(plan.end_ids)):
        assert gate.forcing
        forced.append(plan.end_ids[min(gate.forced, len(plan.end_ids) - 1)])
        gate.advance(forced[-1])
    assert forced == list(plan.end_ids) and gate.phase is Phase.ANSWER and not gate.forcing


def test_new_splitter_picks_harmony_for_a_harmony_plan() -> None:
    assert isinstance(new_splitter(plan_after(GENERATION_PROMPT)), HarmonySplitter)
