"""Memory under sustained load: the server's RSS sampled while it answers many short requests.

Starts `python -m server serve` on a free port (or measures --pid at --base-url), sends --requests chat requests
at --concurrency with varied prompts, samples the server's RSS every --every requests, and reports the samples
and the spread after the warm-up tenth. Prints a table and JSON.
    python bench/rss_soak.py [--requests 1000] [--concurrency 8] [--max-tokens 8] [-- extra serve args]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx
from local_server import start_local_server


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


async def soak(base_url: str, pid: int, requests: int, concurrency: int, max_tokens: int, every: int) -> list[dict]:
    samples: list[dict] = []
    done = 0
    counter = iter(range(requests))

    async def client_loop(client: httpx.AsyncClient) -> None:
        nonlocal done
        for i in counter:
            body = {"model": "", "messages": [{"role": "user", "content": f"Request {i}: say something about {i % 97}."}],
                    "max_tokens": max_tokens, "temperature": 0.7, "seed": i, "stream": i % 2 == 0}
            models = (await client.get("/v1/models")).json()["data"]
            body["model"] = models[0]["id"]
            if body["stream"]:
                async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                    async for _ in resp.aiter_lines():
                        pass
            else:
                (await client.post("/v1/chat/completions", json=body)).raise_for_status()
            done += 1
            if done % every == 0:
                samples.append({"requests": done, "rss_mib": round(rss_mib(pid), 1)})

    async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("serve_args", nargs="*", help="extra arguments for `server serve` (after --)")
    args = parser.parse_args()
    proc, base_url = start_local_server(*args.serve_args)
    try:
        start = rss_mib(proc.pid)
        t0 = time.perf_counter()
        samples = asyncio.run(soak(base_url, proc.pid, args.requests, args.concurrency, args.max_tokens, args.every))
        elapsed = time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait()
    steady = [s["rss_mib"] for s in samples if s["requests"] > args.requests // 10]
    mean = sum(steady) / len(steady)
    spread = max(abs(v - mean) / mean for v in steady)
    print("| requests served | RSS MiB |\n|---|---|")
    print(f"| 0 (ready) | {start:.1f} |")
    for s in samples:
        print(f"| {s['requests']} | {s['rss_mib']} |")
    print(json.dumps({"requests": args.requests, "concurrency": args.concurrency, "seconds": round(elapsed, 1),
                      "rss_ready_mib": round(start, 1), "samples": samples,
                      "steady_mean_mib": round(mean, 1), "steady_max_deviation": round(spread, 4)}, indent=2))


if __name__ == "__main__":
    main()
