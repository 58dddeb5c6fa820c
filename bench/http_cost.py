"""The HTTP process's own CPU time per streamed request and per chunk: what limits a server at a few hundred streams.

On a GPU the engine makes a 128-row step in a few milliseconds, so the process that parses requests and writes
the streams must keep up with thousands of requests and tens of thousands of chunks a second
(bench/RESULTS.md#issue-13-http-cost-stream-task, bench/RESULTS.md#issue-13-http-cost-host-side).
This measures that process alone: a server on a tiny random-weight model (bench/synthetic_model.py's "tiny"
shape, so the engine's time does not matter) with the engine in its own process (`--engine-process`), bursts
of --streams concurrent streaming completions of token-id prompts, a chunk per token (`--stream-interval 1`),
and the HTTP process's CPU seconds (user + system, from /proc) over each burst. Two lengths separate the
request's fixed cost from the chunk's: per chunk = (cpu(long) - cpu(short)) / (long - short) tokens.

    python bench/http_cost.py [--streams 32] [--bursts 10] [--short 4] [--long 128] [--serve-args "..."]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from local_server import start_local_server
from synthetic_model import SHAPES, write_model_dir


def process_cpu_s(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of process `pid`, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


async def stream(client: httpx.AsyncClient, prompt: list[int], max_tokens: int) -> int:
    """One streaming completion; the number of chunks with text."""
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    chunks = 0
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if line.startswith("data: {") and '"text":""' not in line:
                chunks += 1
    return chunks


async def bursts(base: str, pid: int, streams: int, count: int, max_tokens: int, rng: random.Random) -> dict:
    """`count` bursts of `streams` concurrent requests: the HTTP process's CPU ms per request, and the chunks."""
    limits = httpx.Limits(max_connections=streams + 2)
    user_s = system_s = 0.0
    walls, chunks = [], 0
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as client:
        await stream(client, [rng.randrange(3, 500) for _ in range(16)], max_tokens)  # warm-up
        for _ in range(count):
            prompts = [[rng.randrange(3, 500) for _ in range(16)] for _ in range(streams)]
            cpu0, t0 = process_cpu_s(pid), time.perf_counter()
            got = await asyncio.gather(*(stream(client, p, max_tokens) for p in prompts))
            walls.append(time.perf_counter() - t0)
            cpu1 = process_cpu_s(pid)  # summed over the bursts: one burst is only a few clock ticks
            user_s, system_s = user_s + cpu1[0] - cpu0[0], system_s + cpu1[1] - cpu0[1]
            chunks += sum(got)
    n = count * streams
    return {"max_tokens": max_tokens, "cpu_ms_per_request": round(1000 * (user_s + system_s) / n, 3),
            "system_ms_per_request": round(1000 * system_s / n, 3),
            "wall_s_median": round(statistics.median(walls), 3),
            "chunks_per_request": round(chunks / (count * streams), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--bursts", type=int, default=10)
    ap.add_argument("--short", type=int, default=4, help="tokens of the short requests")
    ap.add_argument("--long", type=int, default=128, help="tokens of the long requests")
    ap.add_argument("--serve-args", default="", help="more `serve` flags")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        write_model_dir(SHAPES["tiny"], Path(tmp) / "tiny", device="cpu")
        proc, base = start_local_server("--model", str(Path(tmp) / "tiny"), "--served-model-name", "m",
                                        "--engine-process", "--stream-interval", "1",
                                        "--max-running", str(max(args.streams, 32)), *shlex.split(args.serve_args))
        try:
            short = asyncio.run(bursts(base, proc.pid, args.streams, args.bursts, args.short, rng))
            long = asyncio.run(bursts(base, proc.pid, args.streams, args.bursts, args.long, rng))
        finally:
            proc.terminate()
            proc.wait(30)
    per_chunk = (long["cpu_ms_per_request"] - short["cpu_ms_per_request"]) / (
        long["chunks_per_request"] - short["chunks_per_request"])
    report = {"streams": args.streams, "bursts": args.bursts, "serve_args": args.serve_args, "short": short,
              "long": long, "cpu_us_per_chunk": round(1000 * per_chunk, 1),
              "cpu_ms_per_request_fixed": round(short["cpu_ms_per_request"] - per_chunk * short["chunks_per_request"],
                                                3)}
    print(f"| streams | HTTP-process CPU per request (fixed) | per chunk | {args.short}-token request | "
          f"{args.long}-token request |\n|---|---|---|---|---|\n| {args.streams} | "
          f"{report['cpu_ms_per_request_fixed']} ms | {report['cpu_us_per_chunk']} µs | "
          f"{short['cpu_ms_per_request']} ms | {long['cpu_ms_per_request']} ms |")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
