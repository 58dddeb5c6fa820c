"""Structured outputs with the real SmolLM2 vocabulary: every output decoded under the grammar's mask (by the
brute-force driver of conftest.py, no model) is what the request asked for; bad requests are refused by field."""
from __future__ import annotations

import json
import math
import re
import time

import jsonschema
import pytest
import torch

from server.grammar.compiler import GrammarCompiler, GrammarSpec, StructuredOutputError
from server.api.openai.protocol import ResponseFormat, StructuredOutputs
from server.sampling.params import SamplingParams
from server.sampling.sampler import SequenceSampler, sample_batch
from server.api.openai.structured_outputs import output_grammar
from server.grammar.token_bitmask import allocate_bitmask, allowed_tokens, apply_token_bitmask, unpack_bitmask
from tests.support.schema_cases import OBJ, SCHEMAS

STRING_LITERAL = re.compile(r'"(?:[^"\\]|\\.)*"')


def _no_free_whitespace(text: str) -> bool:
    """Outside string literals only json.dumps' separators: one space after each ',' and ':'."""
    bare = STRING_LITERAL.sub('""', text)
    return not re.search(r"[\n\r\t]| {2,}|[^,:] ", bare)


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_every_output_validates_against_its_schema(grammars, drive, index):
    schema = SCHEMAS[index]
    grammar = grammars.compile(GrammarSpec.json_schema(schema))
    for seed, greedy in ((index, True), (index + 100, False)):
        walk = drive(grammar, seed=seed, greedy=greedy)
        assert walk.complete, f"no complete output in 400 tokens: {walk.text!r}"
        value = json.loads(walk.text)
        jsonschema.validate(value, schema)
        assert _no_free_whitespace(walk.text), walk.text


def test_json_object_always_parses(grammars, drive, smol_tokenizer):
    spec = output_grammar(ResponseFormat(type="json_object"), None)
    grammar = grammars.compile(spec)
    # Even a model that loves newlines gets compact JSON (a newline can only stand outside strings).
    whitespace = torch.tensor([8.0 if b"\n" in smol_tokenizer.token_bytes(i) else 0.0
                               for i in range(smol_tokenizer.vocab_size)])
    for seed in range(6):
        walk = drive(grammar, seed=seed, greedy=seed % 2 == 0, bias=whitespace if seed >= 4 else None)
        assert walk.complete, walk.text
        assert isinstance(json.loads(walk.text), dict)
        assert _no_free_whitespace(walk.text), walk.text


@pytest.mark.parametrize("regex", [r"[a-c]{2,4}-[0-9]", r"(cat|dog)s?", r"[0-9]{3}-[0-9]{4}", r"[A-Z][a-z]+ [A-Z][a-z]+"])
def test_regex_is_honoured(grammars, drive, regex):
    grammar = grammars.compile(output_grammar(None, StructuredOutputs(regex=regex)))
    for seed in range(3):
        walk = drive(grammar, seed=seed, greedy=False, max_steps=60)
        assert walk.complete and re.fullmatch(regex, walk.text), walk.text


def test_choice_is_honoured(grammars, drive):
    options = ["positive", "negative", "neutral ground", "¿qué?"]
    grammar = grammars.compile(output_grammar(None, StructuredOutputs(choice=options)))
    assert {drive(grammar, seed=s, greedy=False).text for s in range(12)} <= set(options)


@pytest.mark.parametrize("grammar_text, reference", [
    ('root ::= "(" [0-9]+ ("," [0-9]+)* ")"', r"\([0-9]+(,[0-9]+)*\)"),
    ('root ::= greeting " " name\ngreeting ::= "hi" | "hello"\nname ::= [a-z]{2,5}', r"(hi|hello) [a-z]{2,5}"),
    ('start: "x=" NUM ";"\nNUM: /[0-9]{1,3}/', r"x=[0-9]{1,3};"),  # Lark
])
def test_grammar_is_honoured(grammars, drive, grammar_text, reference):
    grammar = grammars.compile(output_grammar(None, StructuredOutputs(grammar=grammar_text)))
    for seed in range(3):
        walk = drive(grammar, seed=seed, greedy=False, max_steps=60)
        assert walk.complete and re.fullmatch(reference, walk.text), walk.text


@pytest.mark.parametrize("request_fields, param, words", [
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "needs a schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
     "response_format.json_schema.schema", "not a valid JSON Schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"minimum": "3"}}}},
     "response_format.json_schema.schema", "not a valid JSON Schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"dependentSchemas": {"a": {}}}}}},
     "response_format.json_schema.schema", "dependentSchemas"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "schema": {"type": "string", "pattern": "(?<=a)b"}}}}, "response_format.json_schema.schema", "look-around"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex", "unclosed"),
    ({"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs.grammar", "nowhere"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "one constraint"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "not valid JSON"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
     "both"),
])
def test_bad_constraints_are_refused_naming_the_field(grammars, request_fields, param, words):
    fmt = request_fields.get("response_format")
    so = request_fields.get("structured_outputs")
    with pytest.raises(StructuredOutputError) as info:
        spec = output_grammar(ResponseFormat.model_validate(fmt) if fmt else None,
                              StructuredOutputs.model_validate(so) if so else None)
        grammars.compile(spec)
    assert info.value.param == param
    assert words in info.value.message


def test_compiled_grammars_are_cached_and_bounded(smol_tokenizer):
    compiler = GrammarCompiler(smol_tokenizer, cache_size=2)
    compiler.vocabulary()
    a = GrammarSpec.json_schema(SCHEMAS[18])
    started = time.perf_counter()
    first = compiler.compile(a)
    cold = time.perf_counter() - started
    started = time.perf_counter()
    assert compiler.compile(GrammarSpec.json_schema(SCHEMAS[18])) is first
    assert time.perf_counter() - started < 1e-3 < cold
    compiler.compile(GrammarSpec.json_schema(SCHEMAS[1]))
    compiler.compile(GrammarSpec.json_schema(SCHEMAS[2]))
    assert compiler.compile(a) is not first  # evicted: least recently used
    bad = GrammarSpec("regex", "[", "x")
    for _ in range(2):  # a failure is cached too, and names the field of each request
        with pytest.raises(StructuredOutputError):
            compiler.compile(bad)
    with pytest.raises(StructuredOutputError) as info:
        compiler.compile(GrammarSpec("regex", "[", "other"))
    assert info.value.param == "other"


def test_a_grammar_that_compiles_too_long_is_refused(smol_tokenizer):
    compiler = GrammarCompiler(smol_tokenizer, timeout_s=1e-4)
    compiler.vocabulary()
    big = {"type": "object", "properties": {f"field_{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1}}}x$"}
                                            for i in range(300)}}
    with pytest.raises(StructuredOutputError, match="longer than"):
        compiler.compile(GrammarSpec.json_schema(big, "response_format.json_schema.schema"))


def test_matcher_copies_are_independent_and_roll_back(grammars, smol_tokenizer):
    grammar = grammars.compile(GrammarSpec("regex", "ab+c"))
    ids = smol_tokenizer.encode("abbbc", add_special_tokens=False)
    m = grammar.matcher()
    assert m.advance(ids[0])
    fork = m.copy()
    for t in ids[1:]:
        assert fork.advance(t)
    assert fork.is_stopped and not m.is_stopped
    assert fork.rollback(len(ids) - 1) and not fork.is_stopped
    bitmask = allocate_bitmask(2, smol_tokenizer.vocab_size)
    m.fill_bitmask(bitmask, 0)
    fork.fill_bitmask(bitmask, 1)
    assert torch.equal(bitmask[0], bitmask[1])


def test_bitmask_application_matches_a_brute_force_reference():
    gen = torch.Generator().manual_seed(0)
    for vocab, batch in ((49152, 5), (1000, 3), (37, 4)):
        words = (vocab + 31) // 32
        bitmask = torch.randint(-2**31, 2**31 - 1, (2, words), dtype=torch.int32, generator=gen)
        rows = [batch - 1, 0]
        logits = torch.randn(batch, vocab, generator=gen)
        logits[0, 0], logits[batch - 1, 1] = math.inf, math.nan
        got = logits.clone()
        apply_token_bitmask(got, bitmask, rows)
        expected = logits.clone()
        for r, row in enumerate(rows):
            for t in range(vocab):
                if not (int(bitmask[r, t // 32]) >> (t % 32)) & 1 and not math.isnan(expected[row, t]):
                    expected[row, t] = -math.inf  # a NaN stays NaN: the sampler counts it as -inf
        assert torch.equal(got.nan_to_num(), expected.nan_to_num())
        dense = unpack_bitmask(bitmask, vocab)
        assert allowed_tokens(bitmask, 1, vocab) == dense[1].nonzero()[:, 0].tolist()
        bf16 = logits.bfloat16()
        apply_token_bitmask(bf16, bitmask, rows)
        assert torch.equal(bf16.isneginf(), expected.bfloat16().isneginf())


def test_the_sampler_masks_only_constrained_rows_and_keeps_raw_logprobs(grammars, smol_tokenizer):
    vocab = smol_tokenizer.vocab_size
    grammar = grammars.compile(GrammarSpec("choice", json.dumps(["yes", "no"])))
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, vocab, generator=gen)
    params = [SamplingParams(temperature=0, logprobs=True), SamplingParams(temperature=1.0, seed=3, logprobs=True)]
    samplers = [SequenceSampler(params[i % 2], vocab, [1]) for i in range(4)]
    bitmask = allocate_bitmask(2, vocab)
    grammar.matcher().fill_bitmask(bitmask, 0)
    grammar.matcher().fill_bitmask(bitmask, 1)
    allowed = set(allowed_tokens(bitmask, 0, vocab))
    free = sample_batch(logits, samplers)
    masked = sample_batch(logits, [SequenceSampler(params[i % 2], vocab, [1]) for i in range(4)], (bitmask, [1, 2]))
    assert masked[1].token in allowed and masked[2].token in allowed
    assert masked[0].token == free[0].token and masked[3].token == free[3].token
    raw = torch.log_softmax(logits, -1)
    for i, s in enumerate(masked):
        assert s.logprob == pytest.approx(float(raw[i, s.token]), abs=1e-5)
