"""The server layer's overhead: one streaming chat request over HTTP vs the same greedy generation on the engine.

Measures time to first token and decode tokens/s both ways (the engine run first, in this process; then a
server subprocess on a free port, or --base-url for a running one). Prints a table and JSON.
    python bench/http_overhead.py [--model smollm2-135m] [--max-tokens 128] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import httpx
from local_server import start_local_server

MESSAGES = [{"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}]


def engine_alone(model: str, max_tokens: int, repeats: int) -> dict:
    import torch

    from engine import load_runner

    runner = load_runner(model)
    ids = runner.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    runner.generate(ids, 4)  # warm-up
    ttft, rates = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        token = int(torch.argmax(runner.prefill_logits(ids)))
        t1 = time.perf_counter()
        for _ in range(max_tokens - 1):
            token = int(torch.argmax(runner.decode_logits(token)))
        t2 = time.perf_counter()
        ttft.append(t1 - t0)
        rates.append((max_tokens - 1) / (t2 - t1))
    return {"path": "engine", "prompt_tokens": len(ids), "ttft_ms": round(1000 * statistics.median(ttft), 1),
            "decode_tok_s": round(statistics.median(rates), 1)}


def over_http(base_url: str, model: str, max_tokens: int, repeats: int) -> dict:
    body = {"model": model, "messages": MESSAGES, "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    ttft, rates, usage = [], [], {}
    with httpx.Client(base_url=base_url, timeout=600) as client:
        client.post("/v1/chat/completions", json={**body, "stream": False, "max_tokens": 4})  # warm-up
        for _ in range(repeats):
            t0 = time.perf_counter()
            first = None
            with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                resp.raise_for_status()
                for line in resp.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    if first is None and any(c["delta"].get("content") for c in chunk["choices"]):
                        first = time.perf_counter()
            end = time.perf_counter()
            ttft.append(first - t0)
            rates.append((usage["completion_tokens"] - 1) / (end - first))
    return {"path": "http", "prompt_tokens": usage["prompt_tokens"], "ttft_ms": round(1000 * statistics.median(ttft), 1),
            "decode_tok_s": round(statistics.median(rates), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--base-url", help="measure a running server instead of starting one")
    args = parser.parse_args()
    results = [engine_alone(args.model, args.max_tokens, args.repeats)]
    proc = None
    base_url = args.base_url
    if base_url is None:
        proc, base_url = start_local_server("--model", args.model)
    try:
        results.append(over_http(base_url, args.model, args.max_tokens, args.repeats))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait()
    eng, web = results
    summary = {"ttft_overhead_ms": round(web["ttft_ms"] - eng["ttft_ms"], 1),
               "decode_ratio_http_over_engine": round(web["decode_tok_s"] / eng["decode_tok_s"], 3)}
    print("| path | prompt tokens | TTFT ms | decode tok/s |\n|---|---|---|---|")
    for r in results:
        print(f"| {r['path']} | {r['prompt_tokens']} | {r['ttft_ms']} | {r['decode_tok_s']} |")
    print(json.dumps({"model": args.model, "max_tokens": args.max_tokens, "results": results, **summary}, indent=2))


if __name__ == "__main__":
    main()
