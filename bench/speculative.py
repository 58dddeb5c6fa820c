"""Speculative decoding on SmolLM2: tokens/s with and without it, on a copy-heavy and a free-form task, at one
stream and at concurrency 8, with the acceptance figures the server reports.

Configurations, each its own server process started here:
- `baseline`: the default server; `ngram`: the same with `--speculative ngram`;
- with `--draft-pair`: `bf16`, the target with dense bfloat16 weights (`--quant none --dtype bfloat16`), and
  `bf16+int4-draft`, the same target drafting with its own int4 copy (`--draft-model self-int4`).

Tasks (greedy chat completions, fixed max_tokens, `ignore_eos`):
- `copy`: rewrite a ~300-token Python snippet with one small change (rename a function), so the answer is mostly
  a copy of the prompt: what prompt lookup pays on;
- `free`: a short story from a one-line prompt: little to copy, where speculation must not cost (goal >= 0.95x).

Throughput is completion tokens / wall time of a scenario (`--requests` requests per concurrency level, sent by
`concurrency` clients after one uncounted warm-up). Acceptance is the change of /health's spec_decode counters over
the scenario. `same_as_baseline` says whether each request's text equals the baseline configuration's (greedy:
speculation must not change it). Prints a markdown table, and the JSON with `--json-out`.

    .venv/bin/python bench/speculative.py --json-out /tmp/spec.json
    .venv/bin/python bench/speculative.py --draft-pair --json-out /tmp/spec.json
    .venv/bin/python bench/speculative.py --smoke          # seconds: tiny numbers, checks the plumbing
"""
from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import time
from datetime import UTC, datetime
from typing import Any

import httpx

from local_server import start_local_server

SNIPPET = '''import json
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Item:
    name: str
    price: float
    quantity: int

    def total(self) -> float:
        return self.price * self.quantity


def parse_items(path: Path) -> list[Item]:
    """Read the items of an order file: one JSON object per line."""
    items = []
    with path.open() as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            record = json.loads(line)
            items.append(Item(record["name"], float(record["price"]), int(record["quantity"])))
    return items


def order_total(items: list[Item], discount: float = 0.0) -> float:
    """The order's total after a fractional discount."""
    subtotal = sum(item.total() for item in items)
    return round(subtotal * (1 - discount), 2)


def cheapest(items: list[Item]) -> Item | None:
    return min(items, key=lambda item: item.price, default=None)


def main() -> None:
    items = parse_items(Path("order.jsonl"))
    print(f"{len(items)} items, total {order_total(items, 0.1):.2f}")
    best = cheapest(items)
    if best is not None:
        print(f"cheapest: {best.name} at {best.price:.2f}")


if __name__ == "__main__":
    main()
'''

TASKS = {
    "copy": "Rewrite the following Python code with the function `parse_items` renamed to `load_items` everywhere. "
            "Change nothing else and output only the complete code.\n\n" + SNIPPET,
    "free": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}

CONFIGS = {
    "baseline": [],
    "ngram": ["--speculative", "ngram"],
}
DRAFT_PAIR = {
    "bf16": ["--quant", "none", "--dtype", "bfloat16"],
    "bf16+int4-draft": ["--quant", "none", "--dtype", "bfloat16", "--draft-model", "self-int4"],
}
BASELINE_OF = {"ngram": "baseline", "bf16+int4-draft": "bf16"}
SPEC_KEYS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


async def _chat(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> tuple[str, int]:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}
    resp = await client.post("/v1/chat/completions", json=body)
    resp.raise_for_status()
    data = resp.json()
    return data["choices"][0]["message"]["content"], data["usage"]["completion_tokens"]


async def _scenario(base_url: str, model: str, prompt: str, concurrency: int, requests: int,
                    max_tokens: int) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        await _chat(client, model, prompt, max_tokens)  # warm-up: the prompt's prefix is cached for all configs
        before = (await client.get("/health")).json()
        queue = list(range(requests))
        texts: dict[int, str] = {}
        tokens = 0

        async def worker() -> None:
            nonlocal tokens
            while queue:
                i = queue.pop(0)
                texts[i], n = await _chat(client, model, prompt, max_tokens)
                tokens += n

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - started
        after = (await client.get("/health")).json()
    spec = {k: (after.get(k) or 0) - (before.get(k) or 0) for k in SPEC_KEYS}
    drafted, accepted, drafts = (spec["spec_decode_num_draft_tokens"], spec["spec_decode_num_accepted_tokens"],
                                 spec["spec_decode_num_drafts"])
    return {"tokens": tokens, "seconds": round(wall, 3), "tokens_per_s": round(tokens / wall, 2), **spec,
            "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
            "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
            "texts": [texts[i] for i in sorted(texts)]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    configs = dict(CONFIGS) | (DRAFT_PAIR if args.draft_pair else {})
    if args.configs:  # named ones, of either set
        configs = {name: (CONFIGS | DRAFT_PAIR)[name] for name in args.configs}
    results: dict[str, dict[str, Any]] = {}
    for name, flags in configs.items():
        print(f"== {name}: {' '.join(flags) or '(defaults)'}", file=sys.stderr)
        proc, base_url = start_local_server("--model", args.model, *flags, *args.server_args)
        try:
            served = httpx.get(f"{base_url}/v1/models").json()["data"][0]["id"]  # a path is served by its name
            for task, prompt in TASKS.items():
                for concurrency in args.concurrency:
                    key = f"{task}/c{concurrency}"
                    requests = max(args.requests, concurrency)
                    results.setdefault(key, {})[name] = asyncio.run(
                        _scenario(base_url, served, prompt, concurrency, requests, args.max_tokens))
                    r = results[key][name]
                    print(f"   {key}: {r['tokens_per_s']} tok/s, acceptance {r['acceptance_rate']}", file=sys.stderr)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    for by_config in results.values():
        for name, r in by_config.items():
            base = by_config.get(BASELINE_OF.get(name, ""))
            if base is not None:
                r["speedup"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3)
                r["same_as_baseline"] = r["texts"] == base["texts"]
    for by_config in results.values():
        for r in by_config.values():
            r["first_text"] = r.pop("texts")[0][:200]
    return {"benchmark": "speculative", "model": args.model, "max_tokens": args.max_tokens,
            "requests": args.requests, "machine": platform.platform(), "python": platform.python_version(),
            "when": datetime.now(UTC).isoformat(timespec="seconds"), "results": results}


def table(doc: dict[str, Any]) -> str:
    rows = ["| scenario | config | tokens/s | speedup | acceptance | mean accepted length | same output |",
            "|---|---|---|---|---|---|---|"]
    for key, by_config in doc["results"].items():
        for name, r in by_config.items():
            rows.append(f"| {key} | {name} | {r['tokens_per_s']} | {r.get('speedup', '')} | "
                        f"{r['acceptance_rate'] if r['acceptance_rate'] is not None else ''} | "
                        f"{r['mean_acceptance_length'] if r['mean_acceptance_length'] is not None else ''} | "
                        f"{r.get('same_as_baseline', '')} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--requests", type=int, default=4, help="requests per scenario (at least the concurrency)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--draft-pair", action="store_true", help="also the bf16 target with its int4 copy drafting")
    parser.add_argument("--configs", nargs="+", choices=[*CONFIGS, *DRAFT_PAIR],
                        help="only these configurations (default: all of the above)")
    parser.add_argument("--server-args", nargs=argparse.REMAINDER, default=[],
                        help="further flags for every server (last on the command line)")
    parser.add_argument("--json-out", help="write the JSON document here")
    parser.add_argument("--smoke", action="store_true", help="tiny numbers: one stream, 1 request, 8 tokens")
    args = parser.parse_args()
    if args.smoke:
        args.concurrency, args.requests, args.max_tokens = [1], 1, 8
    doc = run(args)
    print(table(doc))
    text = json.dumps(doc, indent=2)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
