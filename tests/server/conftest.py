"""Grammar fixtures: the real SmolLM2 tokenizer, a compiler for it, and a brute-force decoding driver.

The driver stands in for a model: each step it draws random logits, lets the grammar's bitmask forbid tokens (the
sampler's own `apply_token_bitmask`), and takes the best remaining token or a random allowed one. A bias toward
tokens that close strings and containers (and the end tokens) keeps unbounded strings and arrays finite.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from engine.registry import KNOWN_MODELS
from engine.tokenizer.tokenizer import Tokenizer
from engine.weights.gguf import read_gguf_metadata
from server.grammar.compiler import CompiledGrammar, GrammarCompiler
from server.grammar.token_bitmask import allocate_bitmask, allowed_tokens, apply_token_bitmask


@pytest.fixture(scope="session")
def smol_tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf_metadata(read_gguf_metadata(KNOWN_MODELS["smollm2-135m"].path()))


@pytest.fixture(scope="session")
def grammars(smol_tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(smol_tokenizer)


@dataclass
class Walk:
    tokens: list[int]
    text: str
    complete: bool      # the grammar stopped, or an end token was taken where the grammar allowed it
    ended_by_eos: bool


@pytest.fixture(scope="session")
def drive(smol_tokenizer: Tokenizer) -> Callable[..., Walk]:
    tok = smol_tokenizer
    closing = torch.zeros(tok.vocab_size)
    for i in range(tok.vocab_size):
        if any(c in tok.token_bytes(i) for c in b'"}]),'):
            closing[i] = 5.0
    for i in tok.end_token_ids:
        closing[i] = 5.0

    def run(grammar: CompiledGrammar, seed: int = 0, greedy: bool = True, max_steps: int = 400,
            bias: torch.Tensor | None = None, prefix: tuple[int, ...] = ()) -> Walk:
        """One output under `grammar`; `bias` is added to the logits (on top of the closing bias); `prefix`:
        tokens the "model" writes first (each must be allowed)."""
        gen = torch.Generator().manual_seed(seed)
        matcher = grammar.matcher()
        bitmask = allocate_bitmask(1, tok.vocab_size)
        tokens: list[int] = []
        for token in prefix:
            matcher.fill_bitmask(bitmask, 0)
            assert token in allowed_tokens(bitmask, 0, tok.vocab_size)
            assert matcher.advance(token)
            tokens.append(token)
        for _ in range(max_steps):
            if matcher.is_stopped:
                return Walk(tokens, tok.decode(tokens), True, False)
            matcher.fill_bitmask(bitmask, 0)
            logits = torch.randn(1, tok.vocab_size, generator=gen) + (closing if bias is None else closing + bias)
            apply_token_bitmask(logits, bitmask)
            if greedy:
                token = int(logits.argmax())
            else:
                token = int(torch.multinomial(torch.softmax(logits[0], -1), 1, generator=gen))
            assert logits[0, token] > -torch.inf, "the mask left no token"
            if token in tok.end_token_ids:
                assert matcher.is_accepting, "an end token was allowed before the output was complete"
                return Walk(tokens, tok.decode(tokens), True, True)
            assert matcher.advance(token), matcher.error
            tokens.append(token)
        return Walk(tokens, tok.decode(tokens), matcher.is_stopped, False)

    return run
