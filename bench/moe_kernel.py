"""engine/kernels/moe.py's fused experts on a GPU: µs a call and the bandwidth of the routed experts' weights.

Each shape is timed inside a CUDA graph of one call per layer over LAYERS distinct expert stacks (a decode step
reads every layer's routed experts once; more stacks than L2 holds), each layer with its own random routing.
Bandwidth: the bytes of the experts the call routes to (each distinct expert's gate_up and down, scales and biases
included) over its time; `--peak-gbps` gives the fraction of the memory's peak. `--sweep` also times a grid of
tiles for each GEMM and lists the fastest (what chose engine.kernels.moe.moe_config).

    python3 bench/moe_kernel.py [--shapes qwen3-30b-a3b,gpt-oss-20b] [--tokens 1,64] [--sweep] [--json-out F]
"""
from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bench.gemv import per_call_us
from engine.kernels import moe

GROUP = 32


@dataclass(frozen=True)
class Shape:
    experts: int
    top_k: int
    hidden: int
    inter: int
    format: str       # dense (bf16) | mxfp4
    activation: str
    bias: bool


SHAPES = {
    "qwen3-30b-a3b": Shape(128, 8, 2048, 768, "dense", "silu", False),
    "gpt-oss-20b": Shape(32, 4, 2880, 2880, "mxfp4", "swiglu_clamp", True),
    "qwen3-30b-a3b-mxfp4": Shape(128, 8, 2048, 768, "mxfp4", "silu", False),
}
L2_PROOF_BYTES = 1 << 30


def stack(s: Shape, out: int, inp: int) -> moe.ExpertWeights:
    if s.format == "mxfp4":
        blocks = torch.randint(0, 256, (s.experts, out, inp // 2), dtype=torch.uint8, device="cuda")
        scales = torch.randint(118, 122, (s.experts, out, inp // GROUP), dtype=torch.uint8, device="cuda")
        return moe.mxfp4(blocks, scales)
    return moe.dense(torch.randn(s.experts, out, inp, device="cuda", dtype=torch.bfloat16) * 0.02)


def nbytes(w: moe.ExpertWeights) -> int:
    return sum(t.numel() * t.element_size() for t in (w.data, w.scales, w.offsets) if t is not None)


def sweep_grid(block_m: int) -> list[moe.GemmConfig]:
    """4 warps at every tile, 8 at the widest; 3 or 4 stages."""
    return ([moe.GemmConfig(n, k, 4, st) for n, k, st in itertools.product((32, 64, 128), (64, 128, 256), (3, 4))]
            + [moe.GemmConfig(128, k, 8, 3) for k in (128, 256)])


def measure(name: str, s: Shape, tokens: int, sweep: bool, peak_gbps: float) -> dict:
    per_layer = 3 * s.experts * s.hidden * s.inter * (2 if s.format == "dense" else 0.53)
    layers = max(2, min(16, int(L2_PROOF_BYTES // per_layer) + 1))
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [(stack(s, 2 * s.inter, s.hidden), stack(s, s.hidden, s.inter)) for _ in range(layers)]
    biases = [(torch.randn(s.experts, 2 * s.inter, device="cuda", dtype=torch.bfloat16) * 0.1,
               torch.randn(s.experts, s.hidden, device="cuda", dtype=torch.bfloat16) * 0.1) if s.bias else (None, None)
              for _ in range(layers)]
    routes = []
    for _ in range(layers):
        logits = torch.randn(tokens, s.experts, device="cuda", generator=gen)
        w, ids = torch.topk(logits.softmax(-1), s.top_k)
        routes.append((ids, w / w.sum(-1, keepdim=True)))
    x = torch.randn(tokens, s.hidden, device="cuda", dtype=torch.bfloat16)
    routed_bytes = 0.0
    for (gu, dn), (b1, b2), (ids, _) in zip(weights, biases, routes):
        per_expert = (nbytes(gu) + nbytes(dn)) / s.experts + (
            0 if b1 is None else (b1[0].numel() + b2[0].numel()) * 2)
        routed_bytes += ids.unique().numel() * per_expert
    routed_bytes /= layers

    def calls(config: moe.MoeConfig | None) -> Callable[[], None]:
        def run() -> None:
            for (gu, dn), (b1, b2), (ids, w) in zip(weights, biases, routes):
                moe.fused_experts(x, ids, w, gu, dn, b1, b2, s.activation, config=config)
        return run

    default = moe.moe_config(tokens * s.top_k, s.experts, s.hidden, s.inter, s.format != "dense")
    us = per_call_us(calls(None), layers)
    row = {"shape": name, "tokens": tokens, "config": default._asdict(), "us": round(us, 2),
           "routed_mb": round(routed_bytes / 1e6, 2), "gb_s": round(routed_bytes / us / 1e3, 1)}
    row["of_peak"] = round(row["gb_s"] / peak_gbps, 3)
    if sweep:
        def timed(config: moe.MoeConfig) -> float:
            try:
                return per_call_us(calls(config), layers)
            except Exception:  # a tile past the shared memory or registers
                return float("inf")

        timed_gate_up = sorted((timed(default._replace(gate_up=g)), g) for g in sweep_grid(default.block_m))
        best_gate_up = timed_gate_up[0][1]
        timed_down = sorted((timed(default._replace(gate_up=best_gate_up, down=d)), d)
                            for d in sweep_grid(default.block_m))
        row["fastest_gate_up"] = [(round(t, 2), tuple(g)) for t, g in timed_gate_up[:5]]
        row["fastest_down"] = [(round(t, 2), tuple(d)) for t, d in timed_down[:5]]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen3-30b-a3b,gpt-oss-20b", help=f"comma-separated, of {list(SHAPES)}")
    ap.add_argument("--tokens", default="1,64", help="comma-separated tokens a call")
    ap.add_argument("--sweep", action="store_true", help="also time a grid of tiles per GEMM and list the fastest")
    ap.add_argument("--peak-gbps", type=float, default=3350.0, help="the memory's peak (H100 SXM: 3,350 GB/s)")
    ap.add_argument("--json-out", help="write the rows here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/moe_kernel.py needs a CUDA device")
    print(torch.cuda.get_device_name())
    rows = []
    for name in args.shapes.split(","):
        for tokens in map(int, args.tokens.split(",")):
            rows.append(measure(name, SHAPES[name], tokens, args.sweep, args.peak_gbps))
            r = rows[-1]
            print(f"{r['shape']} N={r['tokens']}: {r['us']} µs a call, routed experts {r['routed_mb']} MB, "
                  f"{r['gb_s']} GB/s ({r['of_peak']:.0%} of {args.peak_gbps:.0f})", flush=True)
            for key in ("fastest_gate_up", "fastest_down"):
                if key in r:
                    print(f"  {key}: {r[key]}", flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
