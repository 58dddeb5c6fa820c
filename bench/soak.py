"""Soak a real server: many mixed requests at high concurrency, a fifth of the clients leaving at random moments,
then check that nothing leaked.

Requests mix chat and completions, streaming and not, every sampling field (temperature, top_p/top_k/min_p,
penalties, seeds, logit_bias, stop strings, n, logprobs, echo), prompt lengths from a few tokens to several hundred
(many sharing long prefixes, so the prefix cache and copy-on-write are exercised), and a few invalid requests.
Clients that leave do so before the first token, mid-stream, or while waiting for a non-streamed answer.

Checks, once the load is over: no response with status >= 500 (and every 4xx in the OpenAI envelope), no KV block in
use outside the prefix cache (/health `kv_blocks_used`, which counts cached-but-unreferenced blocks as free), nothing
running or queued (/health and `emberserve:num_requests_running`), and the server's RSS between the first mark
(request 500 by default) and the end within 5%. Prints a table and a JSON document; exit status 1 if a check fails.

    .venv/bin/python bench/soak.py --start --requests 2000 --concurrency 32 --json-out bench/out/soak.json
    .venv/bin/python bench/soak.py --base-url http://127.0.0.1:8000 --pid $(pgrep -f 'server serve')  # a running one
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m"
SYSTEM_PROMPTS = [
    "You are a helpful assistant. Answer briefly and precisely. " * 4,
    "You are a careful translator: translate what the user writes into French, keeping the tone. " * 6,
    "You are a coding assistant for Python. Prefer the standard library, explain in one sentence. " * 10,
]
TOPICS = ["the sea", "a lighthouse", "winter bread", "trains in the mountains", "a small library", "the moon",
          "a robot gardener", "coffee", "maps of old cities", "bees in spring"]


@dataclass
class Outcome:
    kind: str              # "ok", "left", "4xx", "5xx", "transport"
    status: int | None = None
    detail: str = ""


@dataclass
class SoakResult:
    outcomes: Counter = field(default_factory=Counter)
    statuses: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    rss_mib: dict[str, float] = field(default_factory=dict)


def _sampling(rng: random.Random) -> dict[str, Any]:
    body: dict[str, Any] = {}
    roll = rng.random()
    if roll < 0.35:
        body["temperature"] = 0
    elif roll < 0.9:
        body["temperature"] = rng.choice([0.3, 0.7, 1.0, 1.5, 2.0])
        if rng.random() < 0.5:
            body["top_p"] = rng.choice([0.05, 0.5, 0.9, 1.0])
        if rng.random() < 0.4:
            body["top_k"] = rng.choice([-1, 0, 1, 5, 40, 100000])
        if rng.random() < 0.3:
            body["min_p"] = rng.choice([0.0, 0.05, 0.3, 1.0])
    if rng.random() < 0.3:
        body["frequency_penalty"] = rng.uniform(-2, 2)
        body["presence_penalty"] = rng.uniform(-2, 2)
    if rng.random() < 0.2:
        body["repetition_penalty"] = rng.choice([5e-324, 0.5, 1.0, 1.3, 10.0])
    if rng.random() < 0.5:
        body["seed"] = rng.randrange(-2**62, 2**62)
    if rng.random() < 0.15:
        body["logit_bias"] = {str(rng.randrange(49152)): rng.choice([-100, -5, 5, 100]) for _ in range(3)}
    if rng.random() < 0.2:
        body["stop"] = rng.sample(["\n", ".", " the", "ing", "!!"], rng.randint(1, 3))
    if rng.random() < 0.2:
        body["n"] = rng.randint(2, 3)
    if rng.random() < 0.2:
        body["min_tokens"] = rng.randint(0, 4)
    return body


def make_request(rng: random.Random, max_tokens: int) -> tuple[str, dict[str, Any]]:
    """(path, body) of one random request (2% invalid)."""
    stream = rng.random() < 0.6
    tokens = rng.randint(1, max_tokens)
    body: dict[str, Any] = {"model": MODEL, "max_tokens": tokens, "stream": stream, **_sampling(rng)}
    if stream and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    topic = rng.choice(TOPICS)
    if rng.random() < 0.02:  # invalid: must be a 4xx in the envelope, never a 5xx
        body |= rng.choice([{"temperature": -1}, {"model": "nope"}, {"max_tokens": 10**9}, {"n": 0},
                            {"logit_bias": {"99999999": 5}}, {"top_p": 0}])
    if rng.random() < 0.5:
        messages = [{"role": "user", "content": f"Tell me about {topic}." + " More, please." * rng.randint(0, 30)}]
        if rng.random() < 0.6:
            messages.insert(0, {"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        if rng.random() < 0.3:
            body["logprobs"] = True
            body["top_logprobs"] = rng.randint(0, 5)
        return "/v1/chat/completions", {**body, "messages": messages}
    prompt = rng.choice(SYSTEM_PROMPTS) + f" Write about {topic}." if rng.random() < 0.6 else f"About {topic}:"
    if rng.random() < 0.15:
        prompt = [prompt, f"A story about {rng.choice(TOPICS)}:"]  # several prompts in one request
    if rng.random() < 0.25:
        body["logprobs"] = rng.randint(0, 5)
        body["echo"] = rng.random() < 0.3
    return "/v1/completions", {**body, "prompt": prompt}


def _check_error_body(resp_text: str) -> str | None:
    try:
        error = json.loads(resp_text)["error"]
    except (ValueError, KeyError, TypeError):
        return f"not an error envelope: {resp_text[:200]}"
    if set(error) != {"message", "type", "param", "code"} or not isinstance(error["message"], str):
        return f"bad envelope: {error}"
    return None


async def one_request(client: httpx.AsyncClient, path: str, body: dict[str, Any], leave: str | None,
                      rng: random.Random) -> Outcome:
    """Send one request; `leave` is None (read it all), "before", "mid" or "waiting" (give up at that point)."""
    try:
        if body.get("stream"):
            async with client.stream("POST", path, json=body) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")
                    return _status_outcome(resp.status_code, text)
                if leave == "before":
                    return Outcome("left")
                cut = rng.randint(1, 6)
                chunks = 0
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        return Outcome("ok", 200)
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        kind = "5xx" if chunk["error"].get("type") == "server_error" else "4xx"
                        return Outcome(kind, None, f"in-stream error {chunk['error']}")
                    chunks += 1
                    if leave == "mid" and chunks >= cut:
                        return Outcome("left")
                return Outcome("transport", 200, "stream ended without [DONE]")
        timeout = rng.uniform(0.05, 1.5) if leave is not None else None
        resp = await client.post(path, json=body, timeout=timeout or client.timeout)
        return _status_outcome(resp.status_code, resp.text)
    except httpx.TimeoutException:
        return Outcome("left") if leave is not None else Outcome("transport", None, "timed out")
    except httpx.TransportError as e:
        return Outcome("transport", None, repr(e))


def _status_outcome(status: int, text: str) -> Outcome:
    if status >= 500:
        return Outcome("5xx", status, text[:300])
    if status >= 400:
        problem = _check_error_body(text)
        return Outcome("4xx" if problem is None else "5xx", status, problem or "")
    return Outcome("ok", status)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


async def wait_idle(client: httpx.AsyncClient, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        h = (await client.get("/health")).json()
        if h.get("running") == 0 and h.get("queued") == 0:
            return h
        if time.monotonic() > deadline:
            return h
        await asyncio.sleep(0.2)


async def soak(base_url: str, pid: int | None, requests: int, concurrency: int, leave_fraction: float,
               max_tokens: int, mark: int, seed: int) -> SoakResult:
    result = SoakResult()
    rng = random.Random(seed)
    plan = [(make_request(rng, max_tokens), rng.choice(["before", "mid", "waiting"])
             if rng.random() < leave_fraction else None, random.Random(rng.random())) for _ in range(requests)]
    done = 0
    queue: asyncio.Queue = asyncio.Queue()
    for item in plan:
        queue.put_nowait(item)
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as client:

        async def worker() -> None:
            nonlocal done
            while not queue.empty():
                (path, body), leave, r = queue.get_nowait()
                if leave == "waiting" and body.get("stream"):
                    leave = "before"
                outcome = await one_request(client, path, body, leave, r)
                result.outcomes[outcome.kind] += 1
                result.statuses[str(outcome.status)] += 1
                if outcome.kind in ("5xx", "transport"):
                    result.failures.append(f"{path} {json.dumps(body)[:300]} -> {outcome.status} {outcome.detail}")
                done += 1
                if pid is not None and done == mark:
                    result.rss_mib["mark"] = rss_mib(pid)
                if done % max(1, requests // 10) == 0:
                    print(f"soak: {done}/{requests} {dict(result.outcomes)}", file=sys.stderr, flush=True)

        started = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.monotonic() - started
        health = await wait_idle(client, timeout=60)
        metrics = (await client.get("/metrics")).text
    running_metric = next((float(line.split()[-1]) for line in metrics.splitlines()
                           if line.startswith("emberserve:num_requests_running")), None)
    if pid is not None:
        result.rss_mib["end"] = rss_mib(pid)
    result.__dict__.update(health=health, running_metric=running_metric, elapsed_s=round(elapsed, 1))
    return result


def checks(result: SoakResult, rss_tolerance: float) -> dict[str, bool]:
    health = result.__dict__["health"]
    out = {
        "no_5xx": result.outcomes["5xx"] == 0 and result.outcomes["transport"] == 0,
        "kv_blocks_free": health.get("kv_blocks_used") == 0,
        "nothing_running": health.get("running") == 0 and health.get("queued") == 0
                           and result.__dict__["running_metric"] == 0,
    }
    if "mark" in result.rss_mib and "end" in result.rss_mib:
        growth = result.rss_mib["end"] / result.rss_mib["mark"] - 1
        result.rss_mib["growth"] = round(growth, 4)
        # A leak shows as growth. A fall is memory given back after a peak that the mark happened to catch (glibc
        # returns freed pages), which a two-sided check failed on now and then.
        out["rss_flat"] = growth <= rss_tolerance
    return out


def start_server(args: list[str]) -> tuple[subprocess.Popen, str, Path]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = Path(tempfile.mkdtemp()) / "server.log"
    proc = subprocess.Popen([sys.executable, "-m", "server", "serve", "--port", str(port), "--log-level", "warning",
                             *args], cwd=ROOT, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited:\n{log.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url, log
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError("server not ready")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--pid", type=int, help="the server's pid, for RSS (with --start: the started server's)")
    p.add_argument("--start", action="store_true", help="start a server (python -m server serve) for the run")
    p.add_argument("--server-args", default="", help="extra flags for the started server")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--leave", type=float, default=0.2, help="fraction of clients that leave early")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--mark", type=int, default=500, help="request count of the first RSS reading")
    p.add_argument("--rss-tolerance", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out")
    a = p.parse_args(argv)
    proc = log = None
    if a.start:
        proc, a.base_url, log = start_server(a.server_args.split())
        a.pid = proc.pid
    try:
        result = asyncio.run(soak(a.base_url, a.pid, a.requests, a.concurrency, a.leave, a.max_tokens, a.mark,
                                  a.seed))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    verdict = checks(result, a.rss_tolerance)
    doc = {"requests": a.requests, "concurrency": a.concurrency, "leave_fraction": a.leave,
           "elapsed_s": result.__dict__["elapsed_s"], "outcomes": dict(result.outcomes),
           "statuses": dict(result.statuses), "rss_mib": result.rss_mib, "health": result.__dict__["health"],
           "checks": verdict, "failures": result.failures[:20], "cpu": platform.processor() or platform.machine(),
           "cpus": os.cpu_count()}
    print("| requests | concurrency | elapsed s | ok | left | 4xx | 5xx | RSS mark → end MiB | checks |")
    print("|---|---|---|---|---|---|---|---|---|")
    rss = (f"{result.rss_mib.get('mark', float('nan')):.0f} → {result.rss_mib.get('end', float('nan')):.0f}"
           f" ({result.rss_mib.get('growth', float('nan')):+.1%})")
    print(f"| {a.requests} | {a.concurrency} | {doc['elapsed_s']} | {result.outcomes['ok']} | "
          f"{result.outcomes['left']} | {result.outcomes['4xx']} | {result.outcomes['5xx']} | {rss} | "
          f"{'all passed' if all(verdict.values()) else verdict} |")
    print(json.dumps(doc, indent=2))
    if a.json_out:
        Path(a.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json_out).write_text(json.dumps(doc, indent=2))
    if log is not None and not all(verdict.values()):
        print(log.read_text()[-5000:], file=sys.stderr)
    return 0 if all(verdict.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
