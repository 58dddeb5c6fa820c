"""The scripted decoder stack (engine/model/decoder.py) against the same modules run eagerly: bit-identical logits.

Every tiny family in float32 (the exact path), bfloat16 with int4 and with int8 weights; decode steps with one row
reading its keys in place, one row gathered from scattered blocks, several rows with masks, gemma3 past its
sliding window (8); and steps mixing prefill chunks (fresh and over cached blocks) with decode rows. The eager
reference is the same model with `script` off; the scripted module is checked to have run.
"""
from __future__ import annotations

import pytest
import torch

from engine import load_runner
from engine.model.batch import StepRow
from engine.model.layers import CPU_PAGED_DECODE
from tests.support.tiny_models import VARIANTS, prompt_ids

FORMATS = [("float32", "none"), ("bfloat16", "int4"), ("bfloat16", "int8")]


class CountingScript:
    """Stands in for the scripted module, counting its calls and whether each read its keys in place."""

    def __init__(self, scripted: torch.jit.ScriptModule) -> None:
        self.scripted, self.calls, self.in_place = scripted, 0, []

    def __call__(self, x, batch, *args):
        self.calls += 1
        self.in_place.append(batch.span_length > 0 or batch.block_tables is not None)
        return self.scripted(x, batch, *args)


def _runner(tiny, dtype: str, quant: str, scripted: bool, paged: bool | None = None):
    runner = load_runner(str(tiny.safetensors_dir), dtype=dtype, quant=quant)
    if paged is not None:  # decode rows through block tables (the compiled CPU kernel) or the torch paths
        runner.paged_decode = paged
    runner.model.script = scripted
    if scripted:
        runner.model.__dict__["_scripted"] = CountingScript(runner.model.stack(scripted=True))
    return runner


def _decode(runner, tiny, lengths: list[int], steps: int, spacer: bool) -> torch.Tensor:
    """Logits of `steps` greedy decode steps of one sequence per prompt length, all rows in each step.

    `spacer`: a sequence prefilled between the first prompt and its decoding takes the block after the first
    prompt's, so that sequence's keys end up in non-consecutive blocks (the gathered path even for one row).
    """
    seqs = [runner.new_sequence(prompt_ids(tiny, i % 2, n)) for i, n in enumerate(lengths)]
    logits = runner.step([StepRow(s, 0, len(s.tokens)) for s in seqs])
    if spacer:
        other = runner.new_sequence(prompt_ids(tiny, 1, 16))
        runner.step([StepRow(other, 0, 16)])
    out = []
    for _ in range(steps):
        for seq, token in zip(seqs, logits.argmax(-1).tolist()):
            seq.tokens.append(token)
        logits = runner.step([StepRow(s, s.num_computed, len(s.tokens)) for s in seqs])
        out.append(logits)
    return torch.stack(out)


# Decode rows through block tables (the compiled CPU kernels, the default) in every format, and through the torch
# paths (in place, gathered) in the serving format.
PATHS = [(*f, True) for f in FORMATS] * CPU_PAGED_DECODE + [("bfloat16", "int4", False)] + \
    [(*f, False) for f in FORMATS if f != ("bfloat16", "int4")] * (not CPU_PAGED_DECODE)


@pytest.mark.parametrize("dtype,quant,paged", PATHS, ids=[f"{d}-{q}-{'paged' if p else 'torch'}" for d, q, p in PATHS])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("lengths,spacer", [([20], False), ([16], True), ([5, 23, 11], False)],
                         ids=["one-row-in-place", "one-row-gathered", "three-rows"])
def test_scripted_decode_equals_the_eager_modules(tiny_zoo, variant, dtype, quant, lengths, spacer, paged) -> None:
    tiny = tiny_zoo.model(variant)
    steps = 12  # gemma3's window is 8: every row decodes past it
    eager = _decode(_runner(tiny, dtype, quant, scripted=False, paged=paged), tiny, lengths, steps, spacer)
    runner = _runner(tiny, dtype, quant, scripted=True, paged=paged)
    scripted = _decode(runner, tiny, lengths, steps, spacer)
    assert runner.model._scripted.calls == steps + 1 + spacer  # the prefills ran scripted too
    assert runner.model._scripted.in_place[-steps:] == [paged or (len(lengths) == 1 and not spacer)] * steps
    assert torch.equal(scripted, eager)


def _mixed(runner, tiny) -> list[torch.Tensor]:
    """Steps mixing a decode row, a short chunk and a long chunk over cached blocks, and a fresh prompt."""
    a = runner.new_sequence(prompt_ids(tiny, 0, 40))
    out = [runner.step([StepRow(a, 0, 24)])]  # a's first chunk; the rest of it comes over its cached blocks
    b = runner.new_sequence(prompt_ids(tiny, 1, 10))
    out.append(runner.step([StepRow(a, 24, 40), StepRow(b, 0, 10)]))
    b.tokens.append(5)
    c = runner.new_sequence(prompt_ids(tiny, 0, 37), use_prefix_cache=False)
    out.append(runner.step([StepRow(b, 10, 11), StepRow(c, 0, 37, logits="all")]))
    return out


@pytest.mark.parametrize("dtype,quant", FORMATS)
@pytest.mark.parametrize("variant", ["llama_tied", "qwen2", "gemma3"])
def test_scripted_steps_with_prefill_rows_equal_the_eager_modules(tiny_zoo, variant, dtype, quant) -> None:
    tiny = tiny_zoo.model(variant)
    eager = _mixed(_runner(tiny, dtype, quant, scripted=False), tiny)
    runner = _runner(tiny, dtype, quant, scripted=True)
    scripted = _mixed(runner, tiny)
    assert runner.model._scripted.calls == 3
    for s, e in zip(scripted, eager):
        assert torch.equal(s, e)
