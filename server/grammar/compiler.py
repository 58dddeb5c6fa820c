"""Grammar-constrained decoding through llguidance: compiled grammars cached per model, one matcher per sequence.

A `GrammarSpec` says what a request constrains its output to (a JSON schema, a regex, a list of choices, a Lark or
GBNF/EBNF grammar); `GrammarCompiler.compile` turns it into a `CompiledGrammar` once per distinct spec (a bounded
LRU, failures included, so a bad grammar sent again costs nothing), on a thread of its own with a time bound: a
grammar that takes longer is refused, not left to hold up the caller. Each sequence then walks its own
`GrammarMatcher` (a copy of the compiled one's initial state, microseconds): every step fills the sequence's row of
a token bitmask (`server.grammar.token_bitmask`), the sampler masks the logits with it, and the sampled token advances the
matcher. `is_stopped` is true once the grammar admits nothing more (the output is complete).

Why llguidance (bench/grammar_engines.py; bench/RESULTS.md#issue-14-grammar-engines): no dependencies (xgrammar
needs transformers and triton at run time), compiles a new schema far sooner than xgrammar, which precomputes
masks (longest for a large vocabulary), and computes each mask lazily; it has Lark grammars with lazy lexemes, which
tool calls with `tool_choice: "auto"` need (free text until a call's start marker, then the call's grammar).

JSON is generated with `json.dumps`' separators (", " and ": ") and no other whitespace, so that a model cannot run
on in newlines and spaces (unbounded whitespace is the classic failure of JSON mode).
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, TimeoutError as FutureTimeout

import llguidance
import torch

from engine.tokenizer.tokenizer import Tokenizer

from server.grammar.spec import JSON_FORMAT, GrammarSpec, StructuredOutputError
from server.grammar.token_bitmask import bitmask_words

__all__ = ["CompiledGrammar", "GrammarCompiler", "GrammarMatcher", "GrammarSpec", "JSON_FORMAT",
           "StructuredOutputError", "fill_bitmasks", "fill_draft_bitmasks"]

log = logging.getLogger("emberserve.grammar")

DEFAULT_COMPILE_TIMEOUT_S = 5.0
DEFAULT_CACHE_SIZE = 256


def _llguidance_tokenizer(tok: Tokenizer) -> llguidance.LLTokenizer:
    """The vocabulary as llguidance sees it: each token's bytes, special tokens marked (a grammar's text never
    matches them), the end tokens as its EOS set."""

    spelt = [tok.token_bytes(i) for i in range(tok.vocab_size)]
    specials = set(tok.special_token_ids)
    # the token of each single byte a vocabulary has (most byte-level ones all 256; SmolLM2's lacks a few)
    byte_tokens: dict[int, int] = {}
    for i, b in enumerate(spelt):
        if len(b) == 1 and i not in specials:
            byte_tokens.setdefault(b[0], i)

    def spell(ids: list[int]) -> bytes:
        return b"".join(spelt[i] for i in ids)

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False, parse_special=False)

    def exact(data: bytes) -> list[int]:
        """Token ids spelling exactly `data`, or as long a prefix of it as the vocabulary can spell: the tokenizer's
        own encoding when it is exact; else character by character, a character the tokenizer mangles (or a byte
        that is not UTF-8) in byte tokens, stopping before the first byte no token holds (SmolLM2's vocabulary
        has no 0x04 or 0xF2, say, and its tokenizer silently drops them)."""
        text = data.decode("utf-8", errors="surrogateescape")  # a byte that is not UTF-8 → U+DC80..U+DCFF
        broken = any("\udc80" <= c <= "\udcff" for c in text)
        if not broken:
            ids = encode(text)
            if spell(ids) == data:
                return ids
        ids = []
        for char in text:
            raw = bytes([ord(char) - 0xDC00]) if "\udc80" <= char <= "\udcff" else char.encode("utf-8")
            own = [] if len(raw) == 1 and raw[0] >= 0x80 else encode(char)
            if own and spell(own) == raw:
                ids += own
            elif all(b in byte_tokens for b in raw):
                ids += [byte_tokens[b] for b in raw]
            else:
                break
        return ids

    class Vocabulary:  # what llguidance.TokenizerWrapper reads
        eos_token_id = tok.eos_token_id if tok.eos_token_id is not None else min(tok.end_token_ids, default=0)
        bos_token_id = tok.bos_token_id
        tokens = spelt
        special_token_ids = sorted(specials)

        def __call__(self, text: str | bytes) -> list[int]:
            """Token ids whose bytes are exactly `text`'s (or its longest prefix the vocabulary can spell).
            llguidance tokenizes the bytes a grammar forces, which may stop inside a character or hold bytes no
            token has: tokens that spelt other bytes (U+FFFD's, or a character with a byte dropped) would let the
            mask allow a token the grammar then refuses."""
            return exact(text if isinstance(text, bytes) else text.encode("utf-8"))

    eos = sorted(tok.end_token_ids) or [Vocabulary.eos_token_id]
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Vocabulary()), n_vocab=tok.vocab_size, eos_token=eos)


class GrammarMatcher:
    """One sequence's position in its grammar."""

    __slots__ = ("_m", "vocab_size")

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._m, self.vocab_size = matcher, vocab_size

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row `row` of a CPU int32 bitmask [rows, words]."""
        _check_bitmask(bitmask, self.vocab_size)
        target = bitmask[row]
        self._m.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * 4)

    def advance(self, token: int) -> bool:
        """Take the sampled token; False if the grammar does not allow it (the matcher is then in error)."""
        return self._m.consume_token(token)

    @property
    def is_stopped(self) -> bool:
        """The grammar admits no more text (only an end token): the output is complete, or the matcher failed."""
        return self._m.is_stopped()

    @property
    def is_accepting(self) -> bool:
        """The output so far is complete (more may still follow)."""
        return self._m.is_accepting()

    @property
    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None

    def rollback(self, num_tokens: int) -> bool:
        """Undo the last `num_tokens` advances (speculative decoding)."""
        return self._m.rollback(num_tokens)

    def copy(self) -> GrammarMatcher:
        """An independent matcher at the same position (forking `n` choices, snapshots)."""
        return GrammarMatcher(self._m.deep_copy(), self.vocab_size)


def _check_bitmask(bitmask: torch.Tensor, vocab_size: int) -> None:
    if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or not bitmask.is_contiguous():
        raise ValueError("a grammar bitmask must be a contiguous int32 CPU tensor")
    if bitmask.dim() != 2 or bitmask.shape[1] != bitmask_words(vocab_size):
        raise ValueError(f"bitmask must be [rows, {bitmask_words(vocab_size)}], got {list(bitmask.shape)}")


_executor: llguidance.LLExecutor | None = None
_executor_lock = threading.Lock()
# Below this many rows the worker fills them itself: handing them to llguidance's thread pool costs more.
PARALLEL_FILL_ROWS = 8


def fill_bitmasks(matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor) -> None:
    """Fill row i of `bitmask` for matchers[i]; many rows go through llguidance's threads (GIL released)."""
    if not matchers:
        return
    if len(matchers) < PARALLEL_FILL_ROWS:
        for i, m in enumerate(matchers):
            m.fill_bitmask(bitmask, i)
        return
    global _executor
    _check_bitmask(bitmask, matchers[0].vocab_size)
    with _executor_lock:
        if _executor is None:
            _executor = llguidance.LLExecutor()
    _executor.unsafe_compute_mask_ptr([(m._m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(),
                                      bitmask.shape[1] * 4, bitmask.shape[0])


def fill_draft_bitmasks(matcher: GrammarMatcher, tokens: Sequence[int], bitmask: torch.Tensor) -> None:
    """Rows 0..len(tokens) of `bitmask`: the tokens allowed after each prefix of the drafted `tokens` (speculative
    decoding). The rows after a draft the grammar refuses, or after the grammar stopped, are left as they are:
    verification never gets there (the refused draft is rejected; a stopped output ends). The matcher is left
    where it was."""
    advanced = 0
    try:
        for i in range(len(tokens) + 1):
            matcher.fill_bitmask(bitmask, i)
            if i == len(tokens) or not (int(bitmask[i, tokens[i] >> 5]) >> (tokens[i] & 31)) & 1:
                break  # checked first: advancing by a refused token would put the matcher in error
            if not matcher.advance(tokens[i]):
                raise RuntimeError(f"the grammar refused draft token {tokens[i]} its mask allowed: {matcher.error}")
            advanced += 1
            if matcher.is_stopped:
                break
    finally:
        if advanced and not matcher.rollback(advanced):
            raise RuntimeError(f"the grammar could not undo {advanced} drafted tokens: {matcher.error}")


class CompiledGrammar:
    """A grammar ready for a model's vocabulary; `matcher()` starts a sequence on it."""

    def __init__(self, spec: GrammarSpec, initial: llguidance.LLMatcher, vocab_size: int, seconds: float) -> None:
        self.spec, self._initial, self.vocab_size, self.compile_seconds = spec, initial, vocab_size, seconds

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._initial.deep_copy(), self.vocab_size)


class GrammarCompiler:
    """Compiles grammars for one tokenizer: cached (LRU of `cache_size` specs, failures too), each compilation
    bounded by `timeout_s`. Thread-safe; `compile` blocks, so call it off the event loop."""

    def __init__(self, tokenizer: Tokenizer, *, cache_size: int = DEFAULT_CACHE_SIZE,
                 timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S, limits: llguidance.LLParserLimits | None = None) -> None:
        self.tokenizer, self.cache_size, self.timeout_s, self.limits = tokenizer, cache_size, timeout_s, limits
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar | StructuredOutputError] = OrderedDict()
        self._lock = threading.Lock()
        self._vocab: llguidance.LLTokenizer | None = None
        self._vocab_lock = threading.Lock()
        # Its own threads: a compilation that runs past the bound finishes there (llguidance's limits end it)
        # while the caller has already been answered.
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-compile")

    def vocabulary(self) -> llguidance.LLTokenizer:
        """llguidance's view of the vocabulary, built on first use (slow for a large one:
        bench/RESULTS.md#issue-14-grammar-engines)."""
        with self._vocab_lock:
            if self._vocab is None:
                started = time.perf_counter()
                self._vocab = _llguidance_tokenizer(self.tokenizer)
                log.info("grammar vocabulary ready in %.2fs", time.perf_counter() - started)
            return self._vocab

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The compiled grammar for `spec`; StructuredOutputError (with spec.param) when it cannot be used."""
        with self._lock:
            hit = self._cache.get(spec.key)
            if hit is not None:
                self._cache.move_to_end(spec.key)
        if hit is None:
            hit = self._compile(spec)
            with self._lock:
                self._cache[spec.key] = hit
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        if isinstance(hit, StructuredOutputError):
            raise StructuredOutputError(hit.message, spec.param)
        return hit

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar | StructuredOutputError:
        started = time.perf_counter()
        try:
            grammar = spec.llguidance_grammar()
        except ValueError as e:
            return StructuredOutputError(f"invalid {_WHAT[spec.kind]}: {e}")
        vocab = self.vocabulary()
        future = self._pool.submit(self._build, grammar, vocab)
        try:
            matcher, error = future.result(timeout=self.timeout_s)
        except FutureTimeout:
            log.warning("a %s took longer than %.1fs to compile: refused", _WHAT[spec.kind], self.timeout_s)
            return StructuredOutputError(f"the {_WHAT[spec.kind]} took longer than {self.timeout_s:g}s to compile; "
                                         "simplify it")
        if error is not None:
            return StructuredOutputError(f"unsupported or invalid {_WHAT[spec.kind]}: {error}")
        seconds = time.perf_counter() - started
        log.debug("compiled a %s in %.1f ms", _WHAT[spec.kind], seconds * 1e3)
        return CompiledGrammar(spec, matcher, self.tokenizer.vocab_size, seconds)

    def _build(self, grammar: str, vocab: llguidance.LLTokenizer) -> tuple[llguidance.LLMatcher, str | None]:
        matcher = llguidance.LLMatcher(vocab, grammar, log_level=0, limits=self.limits)
        if not matcher.is_error():
            matcher.compute_bitmask()  # the first mask builds the lexer's start states: here, not in a step
        return matcher, (matcher.get_error() or "the grammar failed") if matcher.is_error() else None


_WHAT = {"json_schema": "JSON schema", "regex": "regex", "choice": "choice list", "lark": "Lark grammar",
         "ebnf": "grammar"}
