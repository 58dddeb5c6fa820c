"""The scripted decode step (engine/scripted_decode.py) against the eager modules: bit-identical logits.

Every tiny family in float32 (the exact path), bfloat16 with int4 and with int8 weights; one row reading its keys
in place, one row gathered from scattered blocks, several rows with masks, gemma3 past its sliding window (8).
The eager reference is the same model with `script_decode` off; the scripted module is checked to have run.
"""
from __future__ import annotations

import pytest
import torch

from engine import load_runner
from engine.batch import StepRow
from tiny_models import VARIANTS, prompt_ids

FORMATS = [("float32", "none"), ("bfloat16", "int4"), ("bfloat16", "int8")]


class CountingScript:
    """Stands in for the scripted module, counting its calls and whether each read its keys in place."""

    def __init__(self, scripted: torch.jit.ScriptModule) -> None:
        self.scripted, self.calls, self.in_place = scripted, 0, []

    def __call__(self, *args):
        self.calls += 1
        self.in_place.append(args[9] > 0)  # span_length
        return self.scripted(*args)


def _runner(tiny, dtype: str, quant: str, scripted: bool):
    runner = load_runner(str(tiny.safetensors_dir), dtype=dtype, quant=quant)
    runner.model.script_decode = scripted
    if scripted:
        runner.model.__dict__["_scripted"] = CountingScript(runner.model._scripted_layers())
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


@pytest.mark.parametrize("dtype,quant", FORMATS)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("lengths,spacer", [([20], False), ([16], True), ([5, 23, 11], False)],
                         ids=["one-row-in-place", "one-row-gathered", "three-rows"])
def test_scripted_decode_equals_the_eager_modules(tiny_zoo, variant, dtype, quant, lengths, spacer) -> None:
    tiny = tiny_zoo.model(variant)
    steps = 12  # gemma3's window is 8: every row decodes past it
    eager = _decode(_runner(tiny, dtype, quant, scripted=False), tiny, lengths, steps, spacer)
    runner = _runner(tiny, dtype, quant, scripted=True)
    scripted = _decode(runner, tiny, lengths, steps, spacer)
    assert runner.model._scripted.calls == steps
    assert runner.model._scripted.in_place == [len(lengths) == 1 and not spacer] * steps
    assert torch.equal(scripted, eager)


def test_steps_with_prefill_rows_stay_eager(tiny_zoo) -> None:
    tiny = tiny_zoo.model("llama_tied")
    runner = _runner(tiny, "bfloat16", "int4", scripted=True)
    a = runner.new_sequence(prompt_ids(tiny, 0, 10))
    runner.step([StepRow(a, 0, 10)])
    a.tokens.append(5)
    b = runner.new_sequence(prompt_ids(tiny, 1, 10))
    runner.step([StepRow(a, 10, 11), StepRow(b, 0, 10)])
    assert runner.model._scripted.calls == 0
    a.tokens.append(6)
    runner.step([StepRow(a, 11, 12)])
    assert runner.model._scripted.calls == 1
