"""One expert's matmul on this CPU through each expert stack of engine/model/quant/experts.py, bfloat16 rows:
MXFP4 dequantized for a dense matmul (Mxfp4Experts, the form without the dot kernels) and by integer dot products
(Mxfp4DotExperts), beside int4 / int8 (torch's kernels and the dot ones) and dense bfloat16.

    python bench/expert_matmul.py [--threads 2] [--rows 1 4 16 64]
The shapes are an expert of the small gpt-oss-shaped CPU model (hidden 1024, expert FFN 1024: fused gate/up and
down) and of gpt-oss-20b (hidden and expert FFN 2880). Prints one JSON line per (shape, rows) and a table of
microseconds per call.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

from engine.model.quant.dot import dot_kernels_serve
from engine.model.quant.experts import (DenseExperts, Int4DotExperts, Int4Experts, Int8DotExperts, Mxfp4DotExperts,
                                        Mxfp4Experts)
from engine.model.quant.mxfp4 import quantize_mxfp4

SHAPES = {"gate_up 1024->2048": (2048, 1024), "down 1024->1024": (1024, 1024), "gate_up 2880->5760": (5760, 2880)}
EXPERTS = 2  # the stacks hold two; expert 1 is timed


def _time_us(fn: Callable[[], torch.Tensor], budget_s: float = 0.3, rounds: int = 5) -> float:
    """The best of `rounds` averages: the least disturbed by other work on a shared machine."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        calls, start = 0, time.perf_counter()
        while time.perf_counter() - start < budget_s / rounds or calls < 2:
            fn()
            calls += 1
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dot = dot_kernels_serve(torch.bfloat16)
    print(json.dumps({"cpu": cpu_name(), "threads": args.threads, "dot_kernels": dot}), flush=True)
    table = []
    for name, (out_f, in_f) in SHAPES.items():
        w = torch.randn(EXPERTS, out_f, in_f) * 0.05
        q = quantize_mxfp4(w)
        stacks = {"mxfp4": Mxfp4Experts(q, None, torch.bfloat16), "int4": Int4Experts(w, None, torch.bfloat16),
                  "bf16": DenseExperts(w, None, torch.bfloat16)}
        if dot:
            stacks |= {"mxfp4dot": Mxfp4DotExperts(q, None, torch.bfloat16),
                       "dot4": Int4DotExperts(w, None, torch.bfloat16), "dot8": Int8DotExperts(w, None, torch.bfloat16)}
        for m in args.rows:
            x = torch.randn(m, in_f).bfloat16()
            row = {"shape": name, "rows": m, "threads": args.threads}
            for kind, stack in stacks.items():
                row[f"{kind}_us"] = round(_time_us(lambda: stack.matmul(x, 1)), 1)
            print(json.dumps(row), flush=True)
            table.append(row)
    kinds = [k[:-3] for k in table[0] if k.endswith("_us")]
    print(f"\n{'shape':<20}{'rows':>6}" + "".join(f"{k + ' us':>12}" for k in kinds))
    for r in table:
        print(f"{r['shape']:<20}{r['rows']:>6}" + "".join(f"{r[f'{k}_us']:>12}" for k in kinds))


if __name__ == "__main__":
    main()
