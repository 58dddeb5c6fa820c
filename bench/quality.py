"""Quantization quality: top-1 agreement with the float32 path and perplexity, per model and weight format.

Teacher-forced over the shipped text sample and prompt set (tests/data), every position counted.
    python bench/quality.py [--models smollm2-135m gemma3-270m] [--modes int4 int8 none-bf16]
Prints a table and JSON.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from engine import load_runner
from engine.runtime.quality import compare

DATA = Path(__file__).resolve().parents[1] / "tests" / "data"
MODES = {"int4": dict(quant="int4"), "int8": dict(quant="int8"), "none-bf16": dict(quant="none", dtype="bfloat16")}


def texts_for(runner) -> list[list[int]]:
    prompts = json.loads((DATA / "quality_prompts.json").read_text())
    sample = (DATA / "quality_sample.txt").read_text()
    return [runner.tokenizer.encode(p) for p in prompts] + [runner.tokenizer.encode(sample)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    args = parser.parse_args()
    rows = []
    for model in args.models:
        reference = load_runner(model, dtype="float32", quant="none", prefix_caching=False)
        texts = texts_for(reference)
        for mode in args.modes:
            candidate = load_runner(model, prefix_caching=False, **MODES[mode])
            a = compare(candidate, reference, texts)
            rows.append({"model": model, "mode": mode, "positions": a.positions,
                         "top1_agreement": round(a.top1_agreement, 4), "perplexity": round(a.perplexity, 3),
                         "fp32_perplexity": round(a.reference_perplexity, 3),
                         "perplexity_ratio": round(a.perplexity_ratio, 4)})
            del candidate
    print(f"{'model':<14} {'mode':<10} {'positions':>9} {'top-1 agree':>11} {'ppl':>8} {'fp32 ppl':>8} {'ratio':>7}")
    for r in rows:
        print(f"{r['model']:<14} {r['mode']:<10} {r['positions']:>9} {r['top1_agreement']:>11.4f} "
              f"{r['perplexity']:>8.3f} {r['fp32_perplexity']:>8.3f} {r['perplexity_ratio']:>7.4f}")
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
