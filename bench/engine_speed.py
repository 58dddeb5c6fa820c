"""Engine speed on this machine: load time, RSS, prefill and decode tokens/s per model, through the Runner API.

Each model is measured in its own subprocess so RSS belongs to that model alone. Prints a table and JSON.
    python bench/engine_speed.py [--models smollm2-135m gemma3-270m] [--prompt-tokens 512] [--decode-tokens 128]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def measure(model: str, prompt_tokens: int, decode_tokens: int, dtype: str | None, repeats: int) -> dict:
    import torch

    from engine import load_runner

    t0 = time.perf_counter()
    runner = load_runner(model, dtype=dtype, prefix_caching=False)  # measure real prefill, not cache hits
    load_s = time.perf_counter() - t0
    rss_loaded = _rss_mib()
    text = "The quick brown fox jumps over the lazy dog. " * 200
    ids = runner.tokenizer.encode(text)[:prompt_tokens]
    runner.prefill_logits(ids[:16])  # warm-up: first-call allocations and kernel selection
    prefill, decode = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        logits = runner.prefill_logits(ids)
        prefill.append(time.perf_counter() - t0)
        token = int(torch.argmax(logits))
        t0 = time.perf_counter()
        for _ in range(decode_tokens):
            token = int(torch.argmax(runner.decode_logits(token)))
        decode.append(time.perf_counter() - t0)
    return {
        "model": model, "family": runner.family, "dtype": str(runner.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(), "load_s": round(load_s, 3), "rss_after_load_mib": round(rss_loaded),
        "rss_peak_mib": round(_rss_mib()), "prompt_tokens": len(ids), "decode_tokens": decode_tokens,
        "prefill_tok_s": round(len(ids) / min(prefill), 1), "decode_tok_s": round(decode_tokens / min(decode), 1),
        "decode_ms_per_token": round(1000 * min(decode) / decode_tokens, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.prompt_tokens, args.decode_tokens, args.dtype, args.repeats)))
        return
    results = []
    for model in args.models:
        cmd = [sys.executable, __file__, "--child", model, "--prompt-tokens", str(args.prompt_tokens),
               "--decode-tokens", str(args.decode_tokens), "--repeats", str(args.repeats)]
        if args.dtype:
            cmd += ["--dtype", args.dtype]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": os.getcwd()})
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    machine = {"cpu_count": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version()}
    cols = ["model", "dtype", "threads", "load_s", "rss_after_load_mib", "rss_peak_mib", "prompt_tokens",
            "prefill_tok_s", "decode_tokens", "decode_tok_s", "decode_ms_per_token"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in results:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    print(json.dumps({"machine": machine, "results": results}, indent=2))


if __name__ == "__main__":
    main()
