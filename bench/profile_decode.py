"""Where one decode step's time goes: torch.profiler's operator table for a single stream.

    python bench/profile_decode.py [--model smollm2-135m] [--dtype ...] [--quant ...] [--context 100] [--steps 20]
Prints ms/token over 50 steps, then the top operators by self CPU time over --steps profiled steps.
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from engine import load_runner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--quant", default=None)
    parser.add_argument("--context", type=int, default=100, help="prompt tokens before decoding")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rows", type=int, default=20)
    args = parser.parse_args()
    runner = load_runner(args.model, dtype=args.dtype, quant=args.quant, prefix_caching=False)
    ids = runner.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * (args.context // 8 + 1))
    token = int(runner.prefill_logits(ids[:args.context]).argmax())
    for _ in range(20):  # warm-up
        token = int(runner.decode_logits(token).argmax())
    t0 = time.perf_counter()
    for _ in range(50):
        token = int(runner.decode_logits(token).argmax())
    per_token = (time.perf_counter() - t0) / 50
    print(f"{runner.name}: {runner.dtype} activations, {runner.quant} weights, context {args.context}: "
          f"{1000 * per_token:.2f} ms/token ({1 / per_token:.1f} tokens/s)")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            token = int(runner.decode_logits(token).argmax())
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
