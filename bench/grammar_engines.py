"""Grammar engines on our tokenizers: tokenizer init, grammar compile (cold and cached), per-token mask fill.

    python bench/grammar_engines.py [--engines llguidance,xgrammar] [--models smollm2-135m,gemma3-270m]

The figures of issue 14's engine choice (bench/RESULTS.md#issue-14-grammar-engines). Each engine drives the same
schemas with random choices among the allowed tokens; "fill" is one constrained row's mask per step, the cost the
sampler pays.
llguidance is the engine in use (pyproject.toml); xgrammar runs only where it is installed by hand
(`pip install xgrammar==0.2.8`, which also needs transformers and triton).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from engine.registry import KNOWN_MODELS
from engine.tokenizer.tokenizer import Tokenizer
from engine.weights.gguf import read_gguf_metadata

SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}},
        "required": ["name", "age", "email"], "additionalProperties": False},
    "order": {"type": "object", "properties": {
        "id": {"type": "integer"}, "status": {"enum": ["new", "paid", "shipped"]},
        "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "object", "properties": {
            "sku": {"type": "string", "maxLength": 6}, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "qty"], "additionalProperties": False}},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["id", "status", "items", "address"], "additionalProperties": False},
}


def load_tokenizer(name: str) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(read_gguf_metadata(KNOWN_MODELS[name].path()))


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok: Tokenizer) -> None:
        import llguidance

        self.llg, self.tok = llguidance, tok
        from server.grammar.compiler import _llguidance_tokenizer

        self.lltok = _llguidance_tokenizer(tok)

    def compile(self, schema: dict | None) -> object:
        from server.grammar.compiler import JSON_FORMAT

        g = (self.llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_FORMAT)
             if schema is not None else self.llg.grammar_from("json_schema", '{"type": "object"}'))
        m = self.llg.LLMatcher(self.lltok, g)
        assert not m.is_error(), m.get_error()
        return m

    def matcher(self, compiled: object) -> object:
        return compiled.deep_copy()

    def fill(self, m: object, bitmask: torch.Tensor) -> None:
        m.unsafe_compute_mask_ptr(bitmask[0].data_ptr(), bitmask.shape[1] * 4)

    def accept(self, m: object, t: int) -> bool:
        return m.consume_token(t)

    def done(self, m: object) -> bool:
        return m.is_stopped()


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok: Tokenizer) -> None:
        import xgrammar

        self.xgr, self.tok = xgrammar, tok
        vocab = [b"" if i in tok.special_token_ids else tok.token_bytes(i) for i in range(tok.vocab_size)]
        info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.RAW, vocab_size=tok.vocab_size,
                                      stop_token_ids=sorted(tok.end_token_ids))
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=2)

    def compile(self, schema: dict | None) -> object:
        if schema is None:
            return self.compiler.compile_builtin_json_grammar()
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def matcher(self, compiled: object) -> object:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m: object, bitmask: torch.Tensor) -> None:
        m.fill_next_token_bitmask(bitmask, 0)

    def accept(self, m: object, t: int) -> bool:
        return m.accept_token(t)

    def done(self, m: object) -> bool:
        return m.is_terminated()


def allowed(bitmask: torch.Tensor, vocab: int) -> list[int]:
    bits = (bitmask[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab].nonzero()[:, 0].tolist()


def drive(engine: object, compiled: object, vocab: int, rng: random.Random, max_steps: int = 200) -> list[float]:
    """Per-step fill times (seconds) of one random walk under the mask."""
    m = engine.matcher(compiled)
    bitmask = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)
    times: list[float] = []
    for _ in range(max_steps):
        if engine.done(m):
            break
        t = time.perf_counter()
        engine.fill(m, bitmask)
        times.append(time.perf_counter() - t)
        ok = allowed(bitmask, vocab)
        if not ok:
            break
        # Prefer ending tokens late: pick among allowed ones, uniformly.
        assert engine.accept(m, rng.choice(ok))
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engines", default="llguidance,xgrammar")
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--walks", type=int, default=5)
    args = ap.parse_args()
    engines = {"llguidance": LLGuidance, "xgrammar": XGrammar}
    for ename in args.engines.split(","):
        t = time.perf_counter()
        __import__(ename)
        print(f"import {ename}: {(time.perf_counter() - t) * 1e3:.0f} ms")
    for model in args.models.split(","):
        tok = load_tokenizer(model)
        for ename in args.engines.split(","):
            t = time.perf_counter()
            engine = engines[ename](tok)
            init = time.perf_counter() - t
            print(f"{model} vocab {tok.vocab_size} | {ename}: tokenizer init {init * 1e3:.0f} ms")
            for sname, schema in [("json_object", None), *SCHEMAS.items()]:
                t = time.perf_counter()
                compiled = engine.compile(schema)
                cold = time.perf_counter() - t
                t = time.perf_counter()
                engine.compile(schema)
                again = time.perf_counter() - t
                t = time.perf_counter()
                for _ in range(100):
                    engine.matcher(compiled)
                per_matcher = (time.perf_counter() - t) / 100
                rng, fills = random.Random(0), []
                for _ in range(args.walks):
                    fills += drive(engine, compiled, tok.vocab_size, rng)
                fills.sort()
                print(f"  {sname:12s} compile cold {cold * 1e3:7.1f} ms, again {again * 1e3:6.2f} ms, "
                      f"matcher from compiled {per_matcher * 1e3:5.3f} ms; "
                      f"fill per token median {statistics.median(fills) * 1e6:6.0f} us, "
                      f"p90 {fills[int(len(fills) * 0.9)] * 1e6:6.0f} us, max {fills[-1] * 1e3:5.1f} ms "
                      f"({len(fills)} steps)")


if __name__ == "__main__":
    main()
