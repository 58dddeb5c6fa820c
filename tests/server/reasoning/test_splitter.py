"""The splitter against the rule applied to the whole text at once: however the output is cut into tokens or
chunks, the thinking and the answer come out the same, and no tag leaks into either."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from server.reasoning.formats import REASONING_FORMATS
from server.reasoning.plan import Phase, ReasoningPlan
from server.reasoning.splitter import ReasoningSplitter, Split

FORMATS = list(REASONING_FORMATS.values())


def reference(text: str, start: str, end: str, starts_thinking: bool) -> tuple[str, str]:
    """The rule on the whole output: thinking only where the output opens with the tag (or the prompt did); the
    first closing tag ends it; whitespace inside the tags and before the answer dropped."""
    if starts_thinking:
        body = text
    else:
        stripped = text.lstrip()
        if not stripped.startswith(start):
            return "", text.lstrip()
        body = stripped[len(start):]
    at = body.find(end)
    if at < 0:
        return body.strip(), ""
    return body[:at].strip(), body[at + len(end):].lstrip()


def split_in_pieces(plan: ReasoningPlan, pieces: list[str]) -> Split:
    splitter, out = ReasoningSplitter(plan), Split()
    for i, piece in enumerate(pieces):
        out += splitter.push(1000 + i, piece)  # ids that are no tag: found in the text
    out += splitter.finish()
    return out


def words(fmt):
    # text made of the tags, parts of them, whitespace and plain words, so that tags are often split or near-missed
    atoms = [fmt.start, fmt.end, fmt.start[:2], fmt.end[:-1], fmt.end[-2:], " ", "\n", "\n\n", "a", "b c", "<", "/",
             "[", "think", "x>"]
    return st.lists(st.sampled_from(atoms), max_size=14).map("".join)


def cuts(text: str) -> st.SearchStrategy[list[str]]:
    return st.lists(st.integers(0, len(text)), max_size=8).map(
        lambda points: [text[a:b] for a, b in zip([0, *sorted(points)], [*sorted(points), len(text)])])


@st.composite
def outputs(draw):
    fmt = draw(st.sampled_from(FORMATS))
    text = draw(words(fmt))
    return fmt, text, draw(cuts(text)), draw(st.booleans())


@settings(max_examples=400, deadline=None)
@given(outputs())
def test_any_cutting_gives_the_whole_texts_split(case) -> None:
    fmt, text, pieces, starts_thinking = case
    plan = ReasoningPlan(fmt.start, fmt.end, None, None, (), starts_thinking)
    got = split_in_pieces(plan, pieces)
    assert (got.reasoning, got.answer) == reference(text, fmt.start, fmt.end, starts_thinking), pieces


def test_tags_that_are_tokens_are_found_by_id_even_when_their_text_is_skipped() -> None:
    plan = ReasoningPlan("<think>", "</think>", 3, 4, (4,), False)
    splitter, out = ReasoningSplitter(plan), Split()
    for token, text in [(3, ""), (10, "\n"), (11, "Two and two"), (12, " make four.\n"), (4, ""), (13, "\n\n"),
                        (14, "Four.")]:
        out += splitter.push(token, text)
    out += splitter.finish()
    assert (out.reasoning, out.answer) == ("Two and two make four.", "Four.")
    assert splitter.reasoning_tokens == 5  # the opening tag through the closing one
    assert splitter.phase is Phase.ANSWER


def test_an_answer_that_mentions_a_tag_later_stays_an_answer() -> None:
    plan = ReasoningPlan("<think>", "</think>", 3, 4, (4,), False)
    splitter, out = ReasoningSplitter(plan), Split()
    for token, text in [(10, "Use"), (3, "<think>"), (11, " tags.")]:
        out += splitter.push(token, text)
    out += splitter.finish()
    assert (out.reasoning, out.answer) == ("", "Use<think> tags.")
    assert splitter.reasoning_tokens == 0
