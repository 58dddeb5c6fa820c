"""Weight formats against each other on this CPU: int4 / int8 packed kernels (torch's, and the integer-dot-product
ones of engine/model/quant/dot.py where this CPU has AVX-512 VNNI) vs a dense bfloat16 matmul, by rows.

    python bench/matmul_formats.py [--threads 2] [--rows 1 4 8 16 32 64 128 512]
The shapes are SmolLM2-135M's layer matmuls (fused qkv, o, fused gate/up, down) and its int8 output projection. Prints one JSON line per
(shape, rows) and a table of microseconds per call; where the dense column wins is where engine/model/quant/formats.py
routes prefill tokens to a layer's dense copy (DENSE_MIN_ROWS).
"""
from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.model.quant import Int4Linear, Int8Linear, quantize_4bit, quantize_int8
from engine.model.quant.dot import Int4DotLinear, Int8DotLinear, dot_kernels_serve

SHAPES = {"qkv 576->960": (960, 576), "o 576->576": (576, 576), "gate_up 576->3072": (3072, 576),
          "down 1536->576": (576, 1536), "head 576->49152": (49152, 576)}
KINDS = ("int4", "int8", "dot4", "dot8", "bf16")


def _time_us(fn: Callable[[], torch.Tensor], budget_s: float = 0.3) -> float:
    fn()
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < budget_s or calls < 3:
        fn()
        calls += 1
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 128, 512])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dot = dot_kernels_serve(torch.bfloat16)
    table = []
    for name, (out_f, in_f) in SHAPES.items():
        w = torch.randn(out_f, in_f) * 0.05
        four_bit, (codes, scale) = quantize_4bit(w), quantize_int8(w)
        modules = {"int4": Int4Linear(four_bit, None, torch.bfloat16), "int8": Int8Linear(codes, scale, None, torch.bfloat16)}
        if dot:
            modules["dot4"] = Int4DotLinear(four_bit, None, torch.bfloat16)
            modules["dot8"] = Int8DotLinear(codes, scale, None, torch.bfloat16)
        dense = w.bfloat16()
        for m in args.rows:
            x = torch.randn(m, in_f).bfloat16()
            row = {"shape": name, "rows": m, "threads": args.threads}
            for kind, module in modules.items():
                row[f"{kind}_us"] = round(_time_us(lambda: module.packed_matmul(x)), 1)
            row["bf16_us"] = round(_time_us(lambda: F.linear(x, dense)), 1)
            print(json.dumps(row), flush=True)
            table.append(row)
    kinds = [k for k in KINDS if f"{k}_us" in table[0]]
    print(f"\n{'shape':<20}{'rows':>6}" + "".join(f"{k + ' us':>10}" for k in kinds) + "  fastest")
    for r in table:
        best = min(kinds, key=lambda k: r[f"{k}_us"])
        print(f"{r['shape']:<20}{r['rows']:>6}" + "".join(f"{r[f'{k}_us']:>10}" for k in kinds) + f"  {best}")


if __name__ == "__main__":
    main()
