"""StopChecker: end tokens, stop strings held back while streaming, min_tokens, max_tokens."""
from __future__ import annotations

import random
from collections.abc import Callable, Collection, Mapping, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.registry import KNOWN_MODELS
from engine.tokenizer.tokenizer import Tokenizer
from engine.weights.gguf import read_gguf_metadata
from server.api.openai.protocol import MAX_STOP_STRINGS
from server.scheduling.stopping import StopChecker, StopUpdate

EOS = 2  # SmolLM2's <|im_end|>; the scripted detokenizer uses the same id
SENTENCE = 'The café said: "你好，世界！" 🎉🚀 and then\n\nUser: hello </s> done.'


class ScriptedDetokenizer:
    """A detokenizer whose pieces are given per token id; `tail` is what it holds back until `flush`."""

    def __init__(self, pieces: Mapping[int, str], tail: str = "") -> None:
        self.pieces, self.tail = pieces, tail
        self.pushed: list[int] = []

    def push(self, token_id: int) -> str:
        self.pushed.append(token_id)
        return self.pieces[token_id]

    def flush(self) -> str:
        tail, self.tail = self.tail, ""
        return tail


def scripted(*pieces: str, tail: str = "", **kwargs) -> tuple[StopChecker, ScriptedDetokenizer, list[int]]:
    """A checker over a detokenizer that gives `pieces[i]` for token id i + 10 (ids clear of EOS)."""
    detok = ScriptedDetokenizer({i + 10: p for i, p in enumerate(pieces)} | {EOS: "<|im_end|>"}, tail)
    return StopChecker(detok, **kwargs), detok, [i + 10 for i in range(len(pieces))]


def feed(checker: StopChecker, ids: Sequence[int]) -> list[StopUpdate]:
    """Push ids until the checker finishes or they run out."""
    updates = []
    for i in ids:
        updates.append(checker.push(i))
        if updates[-1].finish_reason is not None:
            break
    return updates


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf_metadata(read_gguf_metadata(KNOWN_MODELS["smollm2-135m"].path()))


# ---- scripted detokenizer ---------------------------------------------------------------------------------------

def test_without_stop_strings_everything_is_sent_at_once():
    checker, _, ids = scripted("a<", "/", "s>")
    assert [u.text for u in feed(checker, ids)] == ["a<", "/", "s>"]
    assert not checker.finished and checker.num_tokens == 3 and checker.text == "a</s>"


def test_stop_string_spanning_tokens_is_held_and_never_sent():
    checker, _, ids = scripted("a<", "/", "s>", "more", stop=["</s>"])
    updates = feed(checker, ids)
    assert updates == [StopUpdate("a", None), StopUpdate("", None), StopUpdate("", "stop", "</s>")]
    assert checker.finished and checker.text == "a" and checker.num_tokens == 3


def test_held_prefix_is_released_when_the_text_diverges():
    checker, _, ids = scripted("a<", "/", "b", stop=["</s>"])
    assert [u.text for u in feed(checker, ids)] == ["a", "", "</b"]
    checker, _, ids = scripted("Hello", " world", stop=["Hello!"])
    assert [u.text for u in feed(checker, ids)] == ["", "Hello world"]


def test_stop_string_in_the_middle_of_one_tokens_text():
    checker, _, ids = scripted("ok ", "abc\n\nUser: hi", stop=["\n\n"])
    assert feed(checker, ids) == [StopUpdate("ok ", None), StopUpdate("abc", "stop", "\n\n")]


def test_stop_string_longer_than_any_token():
    stop = "<|end of the assistant turn|>"
    checker, _, ids = scripted("answer ", *[stop[i:i + 3] for i in range(0, len(stop), 3)], "x", stop=[stop])
    updates = feed(checker, ids)
    assert [u.text for u in updates] == ["answer "] + [""] * (len(updates) - 1)
    assert updates[-1].stop_reason == stop and checker.num_tokens == 1 + -(-len(stop) // 3)


def test_first_completed_stop_string_wins():
    checker, _, ids = scripted("Hello world", stop=["world", "lo"])
    assert feed(checker, ids) == [StopUpdate("Hel", "stop", "lo")]
    # "User" is complete one character before "\n\nUser:" would be, whether the text comes in one token or several.
    for pieces in (["hi\n\nUser: x"], ["hi\n", "\nUs", "er: x"], list("hi\n\nUser: x")):
        checker, _, ids = scripted(*pieces, stop=["\n\nUser:", "User"])
        updates = feed(checker, ids)
        assert (checker.text, updates[-1].stop_reason) == ("hi\n\n", "User")


def test_stop_strings_ending_together_report_the_longest():
    checker, _, ids = scripted("xab", "cd", stop=["bc", "abc"])
    assert feed(checker, ids) == [StopUpdate("x", None), StopUpdate("", "stop", "abc")]


def test_overlapping_stop_prefixes():
    checker, _, ids = scripted("x a", "b", "c", stop=["abc", "ab"])
    assert feed(checker, ids) == [StopUpdate("x ", None), StopUpdate("", "stop", "ab")]
    checker, _, ids = scripted("x a", "b", "d", stop=["abc"])
    assert [u.text for u in feed(checker, ids)] == ["x ", "", "abd"]
    # Leaving "abcd" half way must still find "bce", which began inside the text held for "abcd".
    checker, _, ids = scripted("a", "b", "c", "e", stop=["abcd", "bce"])
    assert feed(checker, ids)[-1] == StopUpdate("a", "stop", "bce")
    assert checker.text == "a"


def test_empty_none_duplicate_and_lone_string_stops():
    checker, _, ids = scripted("a", "b", stop=["", None, "b", "b"])
    assert feed(checker, ids) == [StopUpdate("a", None), StopUpdate("", "stop", "b")]
    checker, _, ids = scripted("a", "b", stop="b")
    assert feed(checker, ids)[-1] == StopUpdate("", "stop", "b")
    checker, _, ids = scripted("a", "b", stop=["", None])
    assert [u.text for u in feed(checker, ids)] == ["a", "b"]


def test_end_token_finishes_releasing_held_text_but_not_its_own():
    checker, detok, ids = scripted("a<", "/", tail="\ufffd", stop=["</s>"], stop_token_ids={EOS, 0})
    updates = feed(checker, [*ids, EOS])
    assert updates == [StopUpdate("a", None), StopUpdate("", None), StopUpdate("</\ufffd", "stop", EOS)]
    assert EOS not in detok.pushed and checker.num_tokens == 3 and checker.text == "a</\ufffd"


def test_ignore_eos_treats_the_end_token_as_text():
    checker, detok, ids = scripted("a", "b", stop_token_ids={EOS}, ignore_eos=True)
    updates = feed(checker, [ids[0], EOS, ids[1]])
    assert [u.text for u in updates] == ["a", "<|im_end|>", "b"]
    assert not checker.finished and detok.pushed == [ids[0], EOS, ids[1]]


def test_min_tokens_delays_end_tokens_and_stop_strings():
    checker, detok, ids = scripted("a", "b", stop_token_ids={EOS}, min_tokens=2)
    updates = feed(checker, [EOS, EOS, EOS])  # only the third, after two tokens, may end it
    assert [u.finish_reason for u in updates] == [None, None, "stop"] and detok.pushed == [EOS, EOS]
    # A stop string completed within the first min_tokens tokens is ordinary text.
    checker, _, ids = scripted("b", "x", stop=["b"], min_tokens=1)
    assert [u.text for u in feed(checker, [ids[0], ids[0], ids[0]])] == ["b", ""]
    assert checker.text == "b"
    # Text held across the min_tokens boundary still counts towards a stop string.
    checker, _, ids = scripted("x", "y", stop=["xy"], min_tokens=1)
    assert feed(checker, ids) == [StopUpdate("", None), StopUpdate("", "stop", "xy")]


def test_max_tokens_finishes_with_length_releasing_held_text():
    checker, _, ids = scripted("a", "</", "s>", tail="\ufffd", stop=["</s>"], max_tokens=2)
    assert feed(checker, ids) == [StopUpdate("a", None), StopUpdate("</\ufffd", "length", None)]
    checker, _, ids = scripted("a", "</s>", stop=["</s>"], max_tokens=2)
    assert feed(checker, ids)[-1] == StopUpdate("", "stop", "</s>")
    checker, _, ids = scripted("a", stop_token_ids={EOS}, max_tokens=2)
    assert feed(checker, [ids[0], EOS])[-1] == StopUpdate("", "stop", EOS)
    checker, _, ids = scripted("a", "b", stop_token_ids={EOS}, max_tokens=1, min_tokens=1)
    assert feed(checker, [EOS]) == [StopUpdate("<|im_end|>", "length", None)]


def test_push_after_finish_raises():
    checker, _, ids = scripted("a", max_tokens=1)
    checker.push(ids[0])
    with pytest.raises(RuntimeError):
        checker.push(ids[0])


def test_rejects_invalid_limits():
    with pytest.raises(ValueError):
        scripted("a", max_tokens=0)
    with pytest.raises(ValueError):
        scripted("a", min_tokens=-1)


# ---- an independent reference, checked against random cases ----------------------------------------------------

def expected_updates(pieces: Sequence[str], ids: Sequence[int], flush_after: Callable[[int], str],
                     stops: Sequence[str], ends: Collection[int], min_tokens: int, max_tokens: int | None,
                     ignore_eos: bool) -> list[tuple[str, str | None, str | int | None]]:
    """(text sent so far, finish_reason, stop_reason) after each token, computed from the whole text by brute force.

    `pieces[k]` is what the detokenizer gives for token k, `flush_after(n)` what it holds after the first n tokens.
    """
    stops = [s for s in stops if s]  # an empty stop string is ignored
    def first_stop(text: str, after: int) -> tuple[int, str] | None:
        for end in range(after + 1, len(text) + 1):
            found = [s for s in stops if text[:end].endswith(s)]
            if found:
                longest = max(found, key=len)
                return end - len(longest), longest
        return None

    def held(text: str) -> int:
        return max((n for n in range(1, len(text) + 1) if any(s.startswith(text[-n:]) and s != text[-n:]
                                                             for s in stops)), default=0)

    out, text = [], ""
    for k, token in enumerate(ids, start=1):
        active = k > min_tokens
        end_token = active and not ignore_eos and token in ends
        seen = len(text)
        if not end_token:
            text += pieces[k - 1]
        last = end_token or (max_tokens is not None and k >= max_tokens)
        full = text + flush_after(k - 1 if end_token else k) if last else text
        hit = first_stop(full, seen) if active else None
        if hit:
            out.append((full[:hit[0]], "stop", hit[1]))
        elif last:
            out.append((full, "stop" if end_token else "length", token if end_token else None))
        else:
            out.append((text[:len(text) - held(text)], None, None))
        if out[-1][1]:
            break
    return out


def random_case(rng: random.Random, text: str, n_tokens: int) -> dict:
    """Stop strings drawn from `text` (some cut short or changed so they diverge) and random limits."""
    stops = []
    for _ in range(rng.randint(1, 3)):
        start = rng.randrange(len(text))
        s = text[start:start + rng.randint(1, 8)]
        if rng.random() < 0.25:
            s = s[:-1] + "#"  # shares a prefix with the text, then diverges
        stops.append(s)
    return {"stop": stops, "min_tokens": rng.choice([0, 0, 0, 1, 3]),
            "max_tokens": rng.choice([None, None, rng.randint(1, n_tokens + 2)]), "ignore_eos": rng.random() < 0.2}


def check_against_reference(checker: StopChecker, pieces: Sequence[str], ids: Sequence[int],
                            flush_after: Callable[[int], str], case: dict, ends: Collection[int]) -> None:
    expected = expected_updates(pieces, ids, flush_after, case["stop"], ends, case["min_tokens"],
                                case["max_tokens"], case["ignore_eos"])
    got, sent = [], ""
    for u in feed(checker, ids):
        sent += u.text
        got.append((sent, u.finish_reason, u.stop_reason))
    assert got == expected, case
    assert checker.text == sent


@pytest.mark.parametrize("seed", range(4))
def test_random_cuts_and_stops_match_the_reference(seed):
    rng = random.Random(seed)
    for _ in range(100):
        cuts = sorted(rng.sample(range(len(SENTENCE) + 1), rng.randint(1, 25)))
        pieces = [SENTENCE[a:b] for a, b in zip([0, *cuts], [*cuts, len(SENTENCE)])]  # some are empty
        ids = [i + 10 for i in range(len(pieces))]
        if rng.random() < 0.4:
            at = rng.randrange(len(ids) + 1)
            ids.insert(at, EOS)
            pieces.insert(at, "<|im_end|>")
        case = random_case(rng, SENTENCE, len(ids))
        detok = ScriptedDetokenizer({i: p for i, p in zip(ids, pieces)})
        checker = StopChecker(detok, stop_token_ids={EOS}, **case)
        check_against_reference(checker, pieces, ids, lambda n: "", case, {EOS})


# ---- the real SmolLM2 tokenizer ---------------------------------------------------------------------------------

def stream(tok: Tokenizer, text: str, **kwargs) -> tuple[list[int], list[StopUpdate], StopChecker]:
    ids = tok.encode(text, add_special_tokens=False)
    checker = StopChecker(tok.detokenizer(skip_special_tokens=True), stop_token_ids=tok.end_token_ids, **kwargs)
    return ids, feed(checker, ids), checker


def test_real_multibyte_characters_are_never_split(tok):
    ids, updates, checker = stream(tok, SENTENCE, stop=["</s>"])
    assert any(u.text == "" for u in updates[:20])  # CJK and emoji take several tokens each
    assert all("\ufffd" not in u.text for u in updates)
    assert checker.text == SENTENCE[:SENTENCE.index("</s>")]


def test_real_stop_string_spanning_three_tokens(tok):
    ids, updates, checker = stream(tok, SENTENCE, stop=["</s>"])
    tail = [tok.decode([i]) for i in ids[len(updates) - 3:len(updates)]]
    assert tail == [" </", "s", ">"]  # the stop string really is spread over three tokens
    assert [u.text for u in updates[-3:]] == [" ", "", ""] and updates[-1].stop_reason == "</s>"


def test_real_stop_string_inside_one_token_and_across_split_characters(tok):
    ids, updates, checker = stream(tok, SENTENCE, stop=["af"])
    assert tok.decode([ids[1]]) == " café" and len(updates) == 2
    assert checker.text == "The c" and updates[-1] == StopUpdate(" c", "stop", "af")
    for stop, before in (("世界", 'The café said: "你好，'), ("🚀", 'The café said: "你好，世界！" 🎉')):
        ids, updates, checker = stream(tok, SENTENCE, stop=[stop])
        assert checker.text == before and updates[-1].stop_reason == stop
        assert all("\ufffd" not in u.text for u in updates)


def test_real_end_token_releases_held_text(tok):
    ids = tok.encode("Done </", add_special_tokens=False) + [EOS]
    checker = StopChecker(tok.detokenizer(skip_special_tokens=True), stop=["</s>"], stop_token_ids=tok.end_token_ids)
    updates = feed(checker, ids)
    assert updates[-2].text.endswith(" ") and updates[-1] == StopUpdate("</", "stop", EOS)
    assert checker.text == "Done </"


def test_real_tokens_and_random_stops_match_the_reference(tok):
    texts = [SENTENCE, "Sure! Here is the list:\n1. 東京タワー 🗼\n2. Kyoto\n\nUser: thanks",
             "def f(x):\n    return x ** 2  # ≈ square ✓\n</code>\nAssistant: 😀😀"]
    rng = random.Random(1234)
    for case_no in range(300):
        text = texts[case_no % len(texts)]
        ids = tok.encode(text, add_special_tokens=False)
        if rng.random() < 0.4:
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(sorted(tok.end_token_ids)))
        detok = tok.detokenizer(skip_special_tokens=True)
        pieces = [detok.push(i) for i in ids]
        assert "".join(pieces) == text

        def flush_after(n: int) -> str:
            d = tok.detokenizer(skip_special_tokens=True)
            for i in ids[:n]:
                d.push(i)
            return d.flush()

        case = random_case(rng, text, len(ids))
        checker = StopChecker(tok.detokenizer(skip_special_tokens=True), stop_token_ids=tok.end_token_ids, **case)
        check_against_reference(checker, pieces, ids, flush_after, case, tok.end_token_ids)


# ---- property tests: any text, any split into tokens, any stop strings ------------------------------------------

class BufferingDetokenizer:
    """Token id → (piece, held): a held piece is kept back (like half a UTF-8 character) until a later token's
    piece or `flush` releases it."""

    def __init__(self, table: Mapping[int, tuple[str, bool]]) -> None:
        self.table, self.buffer = table, ""

    def push(self, token_id: int) -> str:
        piece, held = self.table[token_id]
        self.buffer += piece
        if held:
            return ""
        out, self.buffer = self.buffer, ""
        return out

    def flush(self) -> str:
        out, self.buffer = self.buffer, ""
        return out


CHARS = st.sampled_from(list("aaabb:\n 你🎉"))  # few characters, so stop strings overlap, repeat and half-match


@st.composite
def streams(draw: st.DrawFn) -> tuple[dict, dict[int, tuple[str, bool]], list[int]]:
    """(StopChecker keyword arguments, detokenizer table, token ids): a text made of random chunks and the stop
    strings themselves, cut anywhere into pieces (empty ones too), some held back, with end tokens inserted."""
    stops = draw(st.lists(st.text(CHARS, max_size=5), max_size=MAX_STOP_STRINGS))
    chunk = st.text(CHARS, max_size=6) | st.sampled_from(stops) if any(stops) else st.text(CHARS, max_size=6)
    text = "".join(draw(st.lists(chunk, max_size=8)))
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=len(text) + 3)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    table = {i + 10: (piece, draw(st.booleans())) for i, piece in enumerate(pieces)} | {EOS: ("<|im_end|>", False)}
    ids = [i + 10 for i in range(len(pieces))]
    for at in draw(st.lists(st.integers(0, len(ids)), max_size=2)):
        ids.insert(at, EOS)
    case = {"stop": stops, "min_tokens": draw(st.integers(0, 4)), "ignore_eos": draw(st.booleans()),
            "max_tokens": draw(st.none() | st.integers(1, len(ids) + 2))}
    return case, table, ids


@settings(max_examples=1000, deadline=None)
@given(streams())
def test_any_text_split_anyhow_streams_the_reference_and_never_leaks_a_stop_string(stream) -> None:
    case, table, ids = stream
    replay = BufferingDetokenizer(table)
    pushed = [replay.push(i) for i in ids]  # what each push returns, for the reference
    held = [""] + [BufferingDetokenizer(table) for _ in ids]
    for n in range(1, len(ids) + 1):
        for i in ids[:n]:
            held[n].push(i)
        held[n] = held[n].flush()
    checker = StopChecker(BufferingDetokenizer(table), stop_token_ids={EOS}, **case)
    check_against_reference(checker, pushed, ids, held.__getitem__, case, {EOS})
    # What was sent at any moment is a beginning of the final text: nothing past a stop string went out early.
    checker = StopChecker(BufferingDetokenizer(table), stop_token_ids={EOS}, **case)
    sent = [u.text for u in feed(checker, ids)]
    final = "".join(sent)
    assert all(final.startswith("".join(sent[:k])) for k in range(len(sent)))
    if case["min_tokens"] == 0:  # else a stop string completed within the first min_tokens tokens is plain text
        assert not any(s and s in final for s in case["stop"])


def test_end_sends_what_was_held_back_and_stops() -> None:
    """A grammar that is complete ends the choice at once: the text held back as a possible stop string start,
    and the detokenizer's pending bytes, go out with finish "stop"."""
    checker, _, ids = scripted('{"a": "x', '"}', tail="!", stop=['"}\n'])
    assert checker.push(ids[0]).text == '{"a": "x'
    assert checker.push(ids[1]) == StopUpdate("", None)  # '"}' may start the stop string
    assert checker.end() == StopUpdate('"}!', "stop")
    assert checker.finished and checker.text == '{"a": "x"}!'
    with pytest.raises(RuntimeError):
        checker.end()


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.sampled_from([10, 11, 12, EOS]), min_size=1, max_size=12),
       max_tokens=st.one_of(st.none(), st.integers(1, 12)), min_tokens=st.integers(0, 4), ignore_eos=st.booleans())
def test_ends_at_foretells_a_finish_by_the_token_itself(tokens, max_tokens, min_tokens, ignore_eos) -> None:
    """`ends_at(t)` says True exactly where `push(t)` then finishes with "length" or with "stop" for the end
    token; with no stop strings nothing else finishes a choice (what the scheduler's deferred text relies on)."""
    checker, _, _ = scripted("a", "b", "c", max_tokens=max_tokens, min_tokens=min_tokens, ignore_eos=ignore_eos,
                             stop_token_ids={EOS})
    for token in tokens:
        foretold = checker.ends_at(token)
        update = checker.push(token)
        assert foretold == (update.finish_reason is not None)
        if foretold:
            assert (update.finish_reason, update.stop_reason) in (("length", None), ("stop", EOS))
            break
