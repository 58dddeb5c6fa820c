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


def copy_bandwidth_gbs(mib: int = 512, repeats: int = 5) -> float:
    """STREAM-style copy bandwidth: (bytes read + bytes written) per second of a large tensor copy."""
    import torch

    src = torch.ones(mib << 18, dtype=torch.float32)  # mib MiB
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * 4 / best / 1e9


def weight_bytes_per_token(model) -> int:
    """Bytes of weights one decode step reads: every matrix and scale once, the embedding table only if the
    output projection reads it too (a lookup touches one row), not the packed layers' dense copies (prefill only)."""
    seen, total = set(), 0
    embedding = {t.untyped_storage().data_ptr() for t in model.embed_tokens.state_dict().values()}
    head = {t.untyped_storage().data_ptr() for t in model.lm_head.state_dict().values()}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen or (ptr in embedding and ptr not in head) or name.endswith(".dense"):
            continue
        seen.add(ptr)
        total += t.untyped_storage().nbytes()
    return total


def measure(model: str, prompt_tokens: int, decode_tokens: int, dtype: str | None, quant: str | None,
            repeats: int) -> dict:
    import torch

    from engine import load_runner

    t0 = time.perf_counter()
    runner = load_runner(model, dtype=dtype, quant=quant, prefix_caching=False)  # measure real prefill, not cache hits
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
    weight_bytes = weight_bytes_per_token(runner.model)
    bandwidth = copy_bandwidth_gbs()
    decode_tok_s = decode_tokens / min(decode)
    return {
        "weight_mb_per_token": round(weight_bytes / 1e6, 1), "copy_bandwidth_gb_s": round(bandwidth, 1),
        # tokens/s if each token cost only reading its weights once at the copy bandwidth
        "roofline_fraction": round(decode_tok_s / (bandwidth * 1e9 / weight_bytes), 3),
        "model": model, "family": runner.family, "dtype": str(runner.dtype).removeprefix("torch."), "quant": runner.quant,
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
    parser.add_argument("--quant", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.prompt_tokens, args.decode_tokens, args.dtype, args.quant,
                                 args.repeats)))
        return
    results = []
    for model in args.models:
        cmd = [sys.executable, __file__, "--child", model, "--prompt-tokens", str(args.prompt_tokens),
               "--decode-tokens", str(args.decode_tokens), "--repeats", str(args.repeats)]
        if args.dtype:
            cmd += ["--dtype", args.dtype]
        if args.quant:
            cmd += ["--quant", args.quant]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": os.getcwd()})
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    machine = {"cpu_count": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version()}
    cols = ["model", "dtype", "quant", "threads", "load_s", "rss_after_load_mib", "rss_peak_mib", "prompt_tokens",
            "prefill_tok_s", "decode_tokens", "decode_tok_s", "decode_ms_per_token", "weight_mb_per_token",
            "copy_bandwidth_gb_s", "roofline_fraction"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in results:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    print(json.dumps({"machine": machine, "results": results}, indent=2))


if __name__ == "__main__":
    main()
