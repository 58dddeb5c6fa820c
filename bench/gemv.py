"""engine/kernels/gemv.py's one-row kernel against torch's linear at a model's layer shapes, on a GPU.

Each call is timed inside a CUDA graph of 16 calls, over enough distinct weight matrices (400 MB at least) that no
call finds its weights in L2, as in a decode step that reads every layer once. Prints µs and TB/s per shape for
torch's linear and for the kernel with engine.kernels.gemv's tile choice; `--sweep` also times every tile in a grid and
lists the fastest (what chose gemv_config).

    python3 bench/gemv.py [--shapes 2048x3072,2048x2048,2048x16384,8192x2048,2048x49152] [--sweep] [--json-out F]
"""
from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.kernels import gemv

LLAMA_1B = "2048x3072,2048x2048,2048x16384,8192x2048,2048x49152"  # (in x out): q/k/v, o, gate/up, down, LM head
CALLS = 16
L2_PROOF_BYTES = 400 << 20


def per_call_us(fn: Callable[[], None], calls: int = 0, replays: int = 30) -> float:
    """µs per call of `fn` (`calls` calls, CALLS by default) replayed from a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compiles and warms up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / replays / (calls or CALLS)


def measure(in_features: int, out_features: int, sweep: bool) -> dict:
    weights = max(2, min(CALLS, L2_PROOF_BYTES // (in_features * out_features * 2)))
    ws = [torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(weights)]
    x = torch.randn(1, in_features, device="cuda", dtype=torch.bfloat16)
    outs: list[torch.Tensor | None] = [None] * CALLS
    gigabytes = in_features * out_features * 2 / 1e9

    def calls(matmul: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            for i in range(CALLS):
                outs[i] = matmul(ws[i % weights])
        return run

    row = {"in": in_features, "out": out_features, "linear_us": per_call_us(calls(lambda w: F.linear(x, w))),
           "gemv_config": gemv.gemv_config(out_features, in_features), "served": gemv.serves(x, ws[0]),
           "gemv_us": per_call_us(calls(lambda w: gemv.gemv(x, w)))}
    if sweep:
        timed = []
        for block_n, block_k, warps in itertools.product([2, 4, 8, 16, 32], [128, 256, 512, 1024, 2048], [4, 8, 16]):
            if not 1024 <= block_n * block_k <= 16384 or in_features % block_k:
                continue
            config = (block_n, block_k, warps)
            timed.append((per_call_us(calls(lambda w, config=config: gemv.gemv(x, w, config=config))),
                          block_n, block_k, warps))
        row["fastest"] = [{"us": round(t, 2), "block_n": n, "block_k": k, "warps": w} for t, n, k, w in sorted(timed)[:5]]
    for name in ("linear", "gemv"):
        row[f"{name}_us"] = round(row[f"{name}_us"], 2)
        row[f"{name}_tb_s"] = round(gigabytes / row[f"{name}_us"] * 1e6 / 1e3, 2)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=LLAMA_1B, help="comma-separated INxOUT (default: the llama-1b shape's)")
    ap.add_argument("--sweep", action="store_true", help="also time a grid of tiles and list the fastest")
    ap.add_argument("--json-out", help="write the rows here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/gemv.py needs a CUDA device")
    rows = [measure(*map(int, s.split("x")), args.sweep) for s in args.shapes.split(",")]
    print("| in x out | linear µs (TB/s) | gemv µs (TB/s) | tile (features, inputs, warps) | served |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['in']}x{r['out']} | {r['linear_us']} ({r['linear_tb_s']}) | {r['gemv_us']} ({r['gemv_tb_s']}) "
              f"| {r['gemv_config']} | {r['served']} |")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
