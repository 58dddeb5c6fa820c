"""The harmony call parser on answers as the harmony splitter writes them (a call as `<|start|>{header}<|message|>
{arguments}<|call|>`, the rest plain text), fed a character at a time and whole: the same content and calls, in
OpenAI's streamed shape. The splitter's side, on whole outputs, is tests/server/reasoning/test_harmony.py."""
from __future__ import annotations

from server.api.harmony_calls import HarmonyCallParser

CALL = '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'


def feed(answer: str, step: int) -> tuple[str, HarmonyCallParser, list]:
    parser, content, deltas = HarmonyCallParser(new_id=lambda: "call_1"), "", []
    for at in range(0, len(answer), step):
        text, more = parser.push(answer[at:at + step])
        content, deltas = content + text, deltas + more
    text, more = parser.finish()
    return content + text, parser, deltas + more


def test_text_around_a_call_is_content_and_the_call_streams_its_arguments() -> None:
    answer = f"Let me look <| that up. {CALL}<|call|> done <|"
    for step in (1, 5, len(answer)):
        content, parser, deltas = feed(answer, step)
        assert content == "Let me look <| that up.  done <|" == parser.content
        assert [(c.id, c.name, c.arguments) for c in parser.calls] == [("call_1", "get_weather", '{"city": "Paris"}')]
        assert (deltas[0].id, deltas[0].name, deltas[0].index) == ("call_1", "get_weather", 0)
        assert "".join(d.arguments for d in deltas) == '{"city": "Paris"}'


def test_a_call_cut_off_keeps_its_arguments_so_far() -> None:
    content, parser, _ = feed(CALL[:-4], 4)  # max_tokens inside the arguments
    assert content == "" and parser.calls[0].arguments == '{"city": "Par'


def test_a_header_cut_off_is_no_call() -> None:
    content, parser, deltas = feed("ok <|start|>assistant<|channel|>commentary to=functions.get_", 3)
    assert content == "ok " and parser.calls == [] and deltas == []
