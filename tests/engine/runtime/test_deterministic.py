"""Deterministic steps (`load_runner(..., deterministic=True)`): every token through the same kernels, so that the
logits of a token are bit-identical whether it is prefilled or decoded, in whatever chunk, beside whatever other
rows, or after a prefix taken from the cache. On the real SmolLM2 in its default format (int4 weights, bfloat16
activations) and on the exact float32 path."""
from __future__ import annotations

import pytest
import torch

from engine import Runner, load_runner
from engine.model.batch import StepRow

TEXT = ("The old lighthouse keeper wrote the weather in his ledger every morning: wind, swell, visibility, and the "
        "ships that passed in the night. ") * 12


@pytest.fixture(scope="module", params=[None, "float32"], ids=["int4-bf16", "float32"])
def runner(request) -> Runner:
    return load_runner("smollm2-135m", dtype=request.param, deterministic=True)


def _prompt(runner: Runner, n: int, salt: int = 0) -> list[int]:
    ids = runner.tokenizer.encode(TEXT)
    return [(t + salt) % runner.vocab_size for t in ids[:n]]


def _all_logits(runner: Runner, ids: list[int], chunk: int) -> torch.Tensor:
    """Logits after every position of `ids`, prefilled `chunk` tokens at a time (chunk 1: decoded token by token)."""
    seq = runner.new_sequence(ids, use_prefix_cache=False)
    out = []
    for start in range(0, len(ids), chunk):
        out.append(runner.step([StepRow(seq, start, min(start + chunk, len(ids)), logits="all")]))
    runner.free_sequence(seq)
    return torch.cat(out)


def test_a_token_gets_the_same_logits_in_any_chunk(runner: Runner) -> None:
    ids = _prompt(runner, 100)  # six blocks and a part: chunks of 7 and 64 cross block edges
    whole = _all_logits(runner, ids, 100)
    for chunk in (1, 7, 64):
        assert torch.equal(_all_logits(runner, ids, chunk), whole), chunk


def test_a_cached_prefix_gives_the_cold_logits(runner: Runner) -> None:
    ids = _prompt(runner, 120, salt=3)
    cold = runner.prefill_logits(ids)
    runner.reset_session()
    runner.blocks.reset_prefix_cache()  # only what `first` computes is cached
    first = runner.new_sequence(ids[:100])  # computed and cached: its 6 full blocks
    runner.step([StepRow(first, first.num_computed, 100)])
    runner.free_sequence(first)
    warm = runner.new_sequence(ids)
    assert warm.num_cached == 96
    assert torch.equal(runner.step([StepRow(warm, 96, len(ids))])[0], cold)
    runner.free_sequence(warm)
    snap_runner_logits = runner.prefill_logits(ids[:60])
    snapshot = runner.export_session()
    reused = runner.prefill_logits_reusing(ids, snapshot, 60)
    assert torch.equal(reused, cold)
    del snap_runner_logits, snapshot
    runner.reset_session()


def test_a_row_gets_the_same_logits_beside_any_other_rows(runner: Runner) -> None:
    """One decode row alone, then inside a step of 31 other decode rows and two prefill chunks."""
    target = _prompt(runner, 40, salt=11)

    def decode_alone() -> torch.Tensor:
        seq = runner.new_sequence(target[:-1], use_prefix_cache=False)
        runner.step([StepRow(seq, 0, len(target) - 1)])
        seq.tokens.append(target[-1])
        logits = runner.step([StepRow(seq, len(target) - 1, len(target))])[0]
        runner.free_sequence(seq)
        return logits

    alone = decode_alone()
    seq = runner.new_sequence(target[:-1], use_prefix_cache=False)
    runner.step([StepRow(seq, 0, len(target) - 1)])
    seq.tokens.append(target[-1])
    others = [runner.new_sequence(_prompt(runner, 10 + i, salt=100 + i), use_prefix_cache=False) for i in range(31)]
    runner.step([StepRow(o, 0, len(o.tokens)) for o in others])
    for o in others:
        o.tokens.append(7)
    fresh = [runner.new_sequence(_prompt(runner, n, salt=n), use_prefix_cache=False) for n in (5, 70)]
    rows = ([StepRow(o, o.num_computed, len(o.tokens)) for o in others[:16]] + [StepRow(fresh[0], 0, 5)]
            + [StepRow(seq, len(target) - 1, len(target))] + [StepRow(fresh[1], 0, 70)]
            + [StepRow(o, o.num_computed, len(o.tokens)) for o in others[16:]])
    batched = runner.step(rows)[17]
    for s in [seq, *others, *fresh]:
        runner.free_sequence(s)
    assert torch.equal(batched, alone)
    assert torch.equal(decode_alone(), alone)  # and again alone, after all that
