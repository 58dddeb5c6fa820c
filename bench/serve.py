"""Load generator for any OpenAI-compatible server: streaming /v1/completions under concurrency, plus prefix reuse.

Scenarios (all by default): every prompt length (~16 and ~1024 tokens) at every concurrency (1, 4, 8, 16), each a
fixed number of requests (default max(2*concurrency, 8)) sent back-to-back by `concurrency` workers after one
uncounted warm-up; then a prefix-reuse run: one cold request over a 2048-token prefix new to the server (a per-run
nonce opens it), then 5 warm ones sharing that prefix with a varying question. Greedy, fixed output length.

Prompts are varied natural text cut to length with a chars-per-token ratio measured on the server's tokenizer
(`/tokenize` in its vLLM, llama-cpp-python or llama-server form, or `/extras/tokenize`; else 4 chars/token). Output tokens come from the final
usage chunk (`stream_options.include_usage`) when the server sends one, else from counting content chunks; the
JSON says which ("token_count_source"). TTFT is measured to the first content chunk, inter-token latency as the
gaps between content chunks (per request, pooled). Throughput is total output tokens / scenario wall time. The
prefix row pools its cold and warm requests; the cold/warm TTFT comparison is printed under the table. Servers that
ignore `ignore_eos` (llama-cpp-python) may stop early: "short_outputs" counts those requests. Prints a markdown
table and a JSON document on stdout; progress and errors go to stderr.

    # emberserve
    .venv/bin/python -m server serve --port 8000 --log-level warning &
    .venv/bin/python bench/serve.py --label emberserve --json-out /tmp/ember.json
    # llama.cpp (llama-cpp-python)
    python -m llama_cpp.server --model FILE --n_threads 2 --interrupt_requests False --port 8001 &
    .venv/bin/python bench/serve.py --label llama.cpp --base-url http://127.0.0.1:8001 \\
        --extra-body '{"repeat_penalty": 1.0}' --json-out /tmp/llamacpp.json
    # a quick smoke run
    .venv/bin/python bench/serve.py --concurrency 1 2 --prompt-tokens 16 --max-tokens 8 --requests 2 --prefix-tokens 256
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import secrets
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from typing import Any

import httpx

CORPUS = """The river had carved the valley over ten thousand years, and the village sat where the water slowed.
Every morning the baker opened her shutters before the bells, and the smell of rye drifted down the lane.
A lighthouse keeper writes the weather in a ledger: wind, swell, visibility, and the ships that passed.
In the spring the orchard turned white with blossom, and the bees worked the rows from dawn to dusk.
The committee met on Thursdays to argue about the budget, the roads, and the new roof for the school.
Old maps show a second bridge upstream, but nobody alive remembers crossing it.
When the power failed, the family played cards by candlelight and told stories about their grandparents.
The museum keeps a clock that has not been wound since the war, its hands stopped at twenty past four.
Engineers measured the load on each beam twice, because the first readings disagreed with the model.
A fox crossed the frozen field at noon, leaving a line of prints that the wind soon filled with snow.
The market sold apples, cheese, wool, and knives, and on feast days a man with a bear danced for coins.
Her first novel was rejected eleven times before a small press in the north agreed to print it.
The recipe calls for two cups of flour, a pinch of salt, and butter cold enough to crack.
At the observatory they photographed the same patch of sky every night for three years.
The ferry runs hourly in summer, but in winter it waits at the far shore until the fog lifts.
He repaired radios in a shop no wider than a hallway, surrounded by tubes, coils, and yellowed manuals.
The treaty was signed in a hotel ballroom, and the pen used for it now sits behind glass.
Children learned to swim in the quarry pond, where the water stayed cold even in August.
The train climbed through the pass in a series of loops, so passengers saw the same church three times.
A good editor removes the sentences a writer loves most and leaves the ones the reader needs.
The glacier has retreated two kilometres since the first survey, and its meltwater feeds the lake.
Farmers watched the sky in late summer, because a single hailstorm could ruin the harvest.
The library lent out seeds as well as books, and borrowers returned them after the harvest.
In the workshop the smell of pine shavings mixed with linseed oil and hot glue.
The composer wrote the symphony in a rented room above a tailor, who complained about the piano.
Sailors once navigated by the stars, a lead line, and a careful count of the hours since the last cape.
The city council voted to plant a tree for every child born that year, and the avenues filled with limes.
A thunderstorm rolled in from the west, and within minutes the street ran like a shallow river.
The chemist kept a notebook of failed experiments, which she said taught her more than the successes.
On the island there were more sheep than people, and the post came twice a week by boat.
The bridge was painted red so that it could be seen through the fog by ships entering the bay.
Every autumn the geese left the marsh in long lines, calling to one another as they flew south.
The teacher asked the class to describe their street in exactly one hundred words.
Miners followed the seam of coal deep under the hill, where the air was warm and still.
The festival ended with lanterns floated on the canal, hundreds of small lights drifting to the sea.
A cartographer must decide what to leave out, since a map as detailed as the land would be useless.
The orchestra tuned to the oboe, and the hall went quiet as the conductor raised his hands.
Rain fell for nine days, and the fields along the river became a single brown lake.
The old man kept bees on the roof of his apartment building and sold the honey to his neighbours.
Archaeologists found a comb, a coin, and a child's shoe at the bottom of the well."""
SENTENCES = [line.strip() for line in CORPUS.splitlines()]
QUESTIONS = ["What is the main subject here?", "Which season is mentioned?", "Who kept a notebook?",
             "Name one animal in the text.", "Where did the ferry wait?", "What colour was the bridge?"]


def passage(seed: str, chars: int, head: str = "") -> str:
    """Varied natural text of about `chars` characters: the corpus sentences shuffled by `seed`, cut at a word."""
    rng, parts, n = random.Random(seed), [head] if head else [], len(head)
    while n < chars:  # each pass adds the whole corpus, so this ends
        order = SENTENCES[:]
        rng.shuffle(order)
        parts += order
        n += sum(len(s) + 1 for s in order)
    text = " ".join(parts)[:chars]
    return text.rsplit(" ", 1)[0] if " " in text else text


def text_prompt(key: str, chars: int, i: int) -> str:
    """Request i's prompt of a scenario: its own shuffle of the corpus."""
    return passage(f"{key}-{i}", chars)


def question_prompt(shared: str, i: int) -> str:
    """Request i of the prefix-reuse run: the shared prefix, then a varying question."""
    return f"{shared}\n\nQuestion {i + 1}: {QUESTIONS[i % len(QUESTIONS)]}\nAnswer:"


@dataclass
class Result:
    """One streamed request."""
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    chunks: int = 0
    usage: dict[str, Any] | None = None
    error: str | None = None

    @property
    def output_tokens(self) -> int:
        return int(self.usage["completion_tokens"]) if self.usage else self.chunks


def pct(values: list[float], q: float) -> float | None:
    """The q-th percentile (linear interpolation), in milliseconds; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return round(1000 * (xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)), 1)


class Bench:
    """Streams requests at one server and runs the scenarios."""

    def __init__(self, client: httpx.AsyncClient, args: argparse.Namespace, model: str) -> None:
        self.client, self.args, self.model = client, args, model
        self.extra: dict[str, Any] = args.extra_body

    async def calibrate(self) -> tuple[float, str]:
        """Characters per token of the corpus on the server's tokenizer, and where the figure came from."""
        sample = passage("calibration", 6000)
        attempts = [("/tokenize", {"model": self.model, "prompt": sample}),  # emberserve, vLLM
                    ("/tokenize", {"input": sample}), ("/extras/tokenize", {"input": sample}),  # llama-cpp-python
                    ("/tokenize", {"content": sample})]  # llama.cpp's llama-server
        for path, body in attempts:
            try:
                resp = await self.client.post(path, json=body, timeout=30)
                if resp.status_code == 200:
                    data = resp.json()
                    count = data.get("count") or len(data["tokens"])
                    if count:  # llama-server answers a body it does not read with no tokens: try the next form
                        return len(sample) / count, f"{path} {next(iter(body.keys() - {'model'}))}"
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                pass
        return 4.0, "default (4 chars/token)"

    async def request(self, prompt: str, max_tokens: int) -> Result:
        """Stream one completion; every failure (HTTP status, error event, timeout, transport) lands in `error`."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, **self.extra}
        r, start = Result(), time.perf_counter()
        last = start
        try:
            async with asyncio.timeout(self.args.timeout):
                async with self.client.stream("POST", "/v1/completions", json=body) as resp:
                    if resp.status_code != 200:
                        r.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
                        return r
                    async for line in resp.aiter_lines():  # ends with the stream, bounded by the timeout
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            break
                        chunk = json.loads(data)
                        if chunk.get("error"):
                            r.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
                            break
                        if chunk.get("usage"):
                            r.usage = chunk["usage"]
                        if "".join(c.get("text") or "" for c in chunk.get("choices") or []):
                            now = time.perf_counter()
                            if r.ttft is None:
                                r.ttft = now - start
                            else:
                                r.gaps.append(now - last)
                            last, r.chunks = now, r.chunks + 1
        except TimeoutError:
            r.error = f"timeout after {self.args.timeout}s"
        except Exception as e:  # noqa: BLE001 - any failure is one errored request, not a crashed benchmark
            r.error = f"{type(e).__name__}: {e}"
        if r.error is None and r.ttft is None:
            r.error = "no content in the stream"
        return r

    async def scenario(self, name: str, target: int, make_prompt: Callable[[int], str], n: int, concurrency: int,
                       max_tokens: int, warmup: str) -> tuple[dict[str, Any], list[Result]]:
        """One uncounted warm-up, then requests 0..n-1 taken back-to-back by `concurrency` workers; its summary."""
        print(f"[serve.py] {name}: concurrency {concurrency}, {n} requests", file=sys.stderr)
        if warmup:
            await self.request(warmup, max_tokens)
        results: list[Result] = [Result() for _ in range(n)]
        indices = iter(range(n))

        async def worker() -> None:
            for i in indices:  # shared iterator: each index is taken once
                results[i] = await self.request(make_prompt(i), max_tokens)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        row = summarize(name, concurrency, target, max_tokens, results, time.perf_counter() - start)
        if row["errors"] or row["short_outputs"]:
            print(f"[serve.py]   {row['errors']} errors (first: {row['first_error']}), {row['short_outputs']} "
                  f"requests under {max_tokens} output tokens", file=sys.stderr)
        return row, results


def summarize(name: str, concurrency: int, target: int, max_tokens: int, results: list[Result],
              wall: float) -> dict[str, Any]:
    """One table row / JSON record: latency percentiles, throughput, errors, token counts."""
    ok = [r for r in results if r.error is None]
    errors = [r.error for r in results if r.error is not None]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    gaps = [g for r in ok for g in r.gaps]
    prompt = [r.usage["prompt_tokens"] for r in ok if r.usage and "prompt_tokens" in r.usage]
    with_usage = sum(r.usage is not None for r in ok)
    source = "usage" if ok and with_usage == len(ok) else "chunks" if with_usage == 0 else "mixed"
    out = sum(r.output_tokens for r in ok)
    return {"scenario": name, "concurrency": concurrency, "target_prompt_tokens": target, "requests": len(results),
            "errors": len(errors), "first_error": errors[0] if errors else None,
            "mean_prompt_tokens": round(sum(prompt) / len(prompt), 1) if prompt else None,
            "output_tokens": out, "token_count_source": source, "wall_s": round(wall, 3),
            "short_outputs": sum(r.output_tokens < max_tokens for r in ok),  # stopped early (EOS not ignored)
            "ttft_p50_ms": pct(ttfts, 50), "ttft_p95_ms": pct(ttfts, 95),
            "itl_p50_ms": pct(gaps, 50), "itl_p95_ms": pct(gaps, 95),
            "output_tok_s": round(out / wall, 2) if wall > 0 else None,
            "requests_s": round(len(ok) / wall, 3) if wall > 0 else None}


def _client_process(base_url: str, model: str, prompts: list[Any], concurrency: int, max_tokens: int,
                    timeout: float, extra: dict[str, Any], barrier: Any) -> tuple[float, float, list[dict]]:
    """One load-generator process: its share of the requests, started at the barrier; (start, end, results)."""

    async def go() -> tuple[float, float, list[dict]]:
        limits = httpx.Limits(max_connections=concurrency + 2)
        async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits) as client:
            bench = Bench(client, argparse.Namespace(extra_body=extra, timeout=timeout), model)
            results: list[Result] = [Result() for _ in prompts]
            indices = iter(range(len(prompts)))

            async def worker() -> None:
                for i in indices:
                    results[i] = await bench.request(prompts[i], max_tokens)

            barrier.wait()
            start = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            end = time.perf_counter()
        return start, end, [r.__dict__ for r in results]

    return asyncio.run(go())


def scenario_in_processes(base_url: str, model: str, name: str, target: int, prompts: list[Any], concurrency: int,
                          max_tokens: int, timeout: float, processes: int,
                          extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """`scenario` with the streams spread over `processes` client processes, so that parsing a few hundred
    streams' events never limits what is measured (one Python process tops out near ten thousand events a
    second). Wall time: first start to last end, on the shared monotonic clock."""
    import multiprocessing as mp

    processes = max(1, min(processes, concurrency))
    ctx = mp.get_context("spawn")
    barrier = ctx.Manager().Barrier(processes)
    shares = [prompts[i::processes] for i in range(processes)]
    conc = [concurrency // processes + (i < concurrency % processes) for i in range(processes)]
    print(f"[serve.py] {name}: concurrency {concurrency}, {len(prompts)} requests, {processes} client processes",
          file=sys.stderr)
    with ctx.Pool(processes) as pool:
        outs = pool.starmap(_client_process, [(base_url, model, share, c, max_tokens, timeout, extra or {}, barrier)
                                              for share, c in zip(shares, conc)])
    results = [Result(**r) for _, _, rs in outs for r in rs]
    wall = max(end for _, end, _ in outs) - min(start for start, _, _ in outs)
    return summarize(name, concurrency, target, max_tokens, results, wall) | {"client_processes": processes}


def table(rows: list[dict[str, Any]]) -> str:
    cols = ["scenario", "concurrency", "requests", "errors", "mean_prompt_tokens", "output_tokens", "ttft_p50_ms",
            "ttft_p95_ms", "itl_p50_ms", "itl_p95_ms", "output_tok_s", "requests_s"]
    heads = ["scenario", "conc", "reqs", "errors", "prompt tok", "out tok", "TTFT p50 ms", "TTFT p95 ms",
             "ITL p50 ms", "ITL p95 ms", "out tok/s", "req/s"]
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join("-" if row[c] is None else str(row[c]) for c in cols) + " |" for row in rows]
    return "\n".join(lines)


async def resolve_model(client: httpx.AsyncClient, wanted: str | None, wait_s: float) -> str:
    """The given model id, or the server's first listed one; waits (bounded) for the server to answer 200."""
    deadline, last = time.monotonic() + wait_s, "no answer"
    while time.monotonic() < deadline:
        try:
            resp = await client.get("/v1/models", timeout=10)
            if resp.status_code == 200:
                return wanted or resp.json()["data"][0]["id"]
            last = f"HTTP {resp.status_code}"
        except httpx.HTTPError as e:
            last = f"{type(e).__name__}: {e}"
        await asyncio.sleep(1)
    raise SystemExit(f"{client.base_url} not ready after {wait_s}s ({last})")


async def run(args: argparse.Namespace) -> dict[str, Any]:
    nonce = secrets.token_hex(4)
    limits = httpx.Limits(max_connections=max(args.concurrency) + 2)
    async with httpx.AsyncClient(base_url=args.base_url, timeout=args.timeout, limits=limits) as client:
        model = await resolve_model(client, args.model, args.wait)
        bench = Bench(client, args, model)
        cpt, calibration = await bench.calibrate()

        def chars(tokens: int) -> int:
            return max(8, round(tokens * cpt))

        rows: list[dict[str, Any]] = []
        for p in args.prompt_tokens:
            for c in args.concurrency:
                key = f"{nonce}-{p}-{c}"  # every request's text differs: no prefix shared within or across runs
                row, _ = await bench.scenario(f"prompt{p}-c{c}", p, partial(text_prompt, key, chars(p)),
                                              args.requests or max(2 * c, 8), c, args.max_tokens,
                                              text_prompt(key, chars(p), -1))
                rows.append(row)
        prefix: dict[str, Any] | None = None
        if not args.no_prefix:  # a nonce opens the prefix: new to the server, shared by this run's requests
            shared = passage(f"{nonce}-prefix", chars(args.prefix_tokens), head=f"Session {nonce}.")
            other = passage(f"{nonce}-warmup", chars(args.prefix_tokens), head=f"Session {nonce}w.")
            row, results = await bench.scenario(f"prefix{args.prefix_tokens}", args.prefix_tokens, partial(question_prompt, shared),
                                                1 + args.warm_requests, 1, args.prefix_max_tokens, other)
            rows.append(row)
            cold = results[0].ttft if results[0].error is None else None
            warm = [r.ttft for r in results[1:] if r.error is None and r.ttft is not None]
            cold_ms, warm_ms = pct([cold] if cold is not None else [], 50), pct(warm, 50)
            prefix = {"cold_ttft_ms": cold_ms, "warm_ttft_p50_ms": warm_ms, "warm_requests": args.warm_requests,
                      "cold_over_warm": round(cold_ms / warm_ms, 2) if cold_ms and warm_ms else None}
    return {"label": args.label, "base_url": args.base_url, "model": model,
            "timestamp": datetime.now(UTC).isoformat(timespec="seconds"), "run_nonce": nonce,
            "parameters": {"concurrency": args.concurrency, "prompt_tokens": args.prompt_tokens,
                           "max_tokens": args.max_tokens, "requests": args.requests or "max(2*concurrency, 8)",
                           "temperature": 0, "ignore_eos": True, "extra_body": bench.extra, "timeout_s": args.timeout,
                           "prefix_tokens": None if args.no_prefix else args.prefix_tokens,
                           "prefix_max_tokens": args.prefix_max_tokens},
            "calibration": {"chars_per_token": round(cpt, 3), "source": calibration},
            "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "machine": platform.machine(),
                        "python": platform.python_version()},
            "scenarios": rows, "prefix_reuse": prefix}


def json_object(text: str) -> dict[str, Any]:
    """--extra-body's value: a JSON object."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise TypeError("not a JSON object")
    return value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", help="model id to send (default: the server's first in /v1/models)")
    ap.add_argument("--label", default="server", help="the server's name in the output, e.g. emberserve")
    ap.add_argument("--concurrency", type=int, nargs="*", default=[1, 4, 8, 16])
    ap.add_argument("--prompt-tokens", type=int, nargs="*", default=[16, 1024])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, help="requests per scenario (default max(2*concurrency, 8))")
    ap.add_argument("--no-prefix", action="store_true", help="skip the prefix-reuse scenario")
    ap.add_argument("--prefix-tokens", type=int, default=2048)
    ap.add_argument("--prefix-max-tokens", type=int, default=8)
    ap.add_argument("--warm-requests", type=int, default=5)
    ap.add_argument("--extra-body", type=json_object, default={}, help='JSON merged into every request body, e.g. \'{"repeat_penalty": 1.0}\'')
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per request, whole stream included")
    ap.add_argument("--wait", type=float, default=60.0, help="seconds to wait for the server to be ready")
    ap.add_argument("--json-out", help="also write the JSON document here")
    args = ap.parse_args()
    if not args.concurrency or min(args.concurrency) < 1 or (args.requests is not None and args.requests < 1):
        ap.error("concurrency values and --requests must be >= 1")
    report = asyncio.run(run(args))
    text = json.dumps(report, indent=2)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(text + "\n")
    print(f"## {args.label} @ {args.base_url} ({report['model']})\n\n{table(report['scenarios'])}")
    if report["prefix_reuse"]:
        pr = report["prefix_reuse"]
        print(f"\nprefix reuse: cold TTFT {pr['cold_ttft_ms']} ms, warm TTFT p50 {pr['warm_ttft_p50_ms']} ms, "
              f"cold/warm {pr['cold_over_warm']}x")
    print(f"\n{text}")


if __name__ == "__main__":
    main()
