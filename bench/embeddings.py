"""Sentence embeddings per second: all-MiniLM-L6-v2 on emberserve (in-process and over HTTP) against
sentence-transformers, on the same CPU in the same run.

64 sentences of about 30 tokens (24 to 36, as real batches vary), embedded as one batch of 64: sentence-transformers'
`encode(batch_size=64)` (its own tokenizer, float32); the engine's `Runner.embed` after tokenizing (float32, and
bfloat16 matmuls over a float32 stream); one POST /v1/embeddings of the 64 sentences (base64, as the openai client
asks by default) to a server subprocess of each dtype. The paths take turns in every repeat, so that a change of
load on the machine falls on all of them; each row is the median of the repeats. The cosine column is the worst
sentence's cosine similarity to sentence-transformers' vectors. Prints a markdown table and JSON.
    python bench/embeddings.py [--repeats 9] [--no-http]
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import random
import statistics
import time
from collections.abc import Callable

import httpx
import numpy as np
import torch
from local_server import start_local_server

MODEL = "all-minilm-l6-v2"
BATCH = 64
_SUBJECTS = ["The committee", "Our small team of engineers", "A curious child", "The city council", "My neighbour",
             "The research group at the university", "An experienced pilot", "The new manager", "Every student",
             "The orchestra"]
_VERBS = ["discussed", "carefully reviewed", "quietly rejected", "enthusiastically approved", "tried to explain",
          "spent the afternoon rewriting", "could not understand", "presented"]
_OBJECTS = ["the proposal for a longer lunch break", "the budget for next year's festival",
            "a detailed plan to repair the old bridge", "the results of the latest experiment",
            "the rules of the chess tournament", "a strange letter that arrived on Monday",
            "the recipe for her grandmother's apple pie", "the schedule of the night trains"]
_TAILS = ["before the meeting ended.", "while it was raining outside.", "because nobody else wanted to.",
          "and then went home early.", "in front of a surprisingly large audience.",
          "although the deadline had already passed.", "with more patience than anyone expected.",
          "after a long and heated debate about costs, risks and the timeline."]


def sentences(count: int, tokenize: Callable[[str], list[int]], low: int = 24, high: int = 36) -> list[str]:
    """`count` different sentences of `low` to `high` tokens, the same in every run."""
    rng, out = random.Random(0), []
    while len(out) < count:
        text = " ".join([rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS), rng.choice(_TAILS)])
        if rng.random() < 0.5:
            text += " " + rng.choice(_SUBJECTS).lower() + " " + rng.choice(_VERBS) + " it too."
        if low <= len(tokenize(text)) <= high and text not in out:
            out.append(text)
    return out


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--no-http", action="store_true", help="leave out the server subprocesses")
    args = parser.parse_args()

    from sentence_transformers import SentenceTransformer

    from engine import load_runner
    from engine.registry import KNOWN_MODELS

    load_before = os.getloadavg()
    reference_model = SentenceTransformer(str(KNOWN_MODELS[MODEL].path()), device="cpu")
    runners = {dtype: load_runner(MODEL, dtype=dtype) for dtype in ("float32", "bfloat16")}
    tokenizer = runners["float32"].tokenizer
    texts = sentences(BATCH, tokenizer.encode)
    lengths = [len(tokenizer.encode(t)) for t in texts]

    def engine(dtype: str) -> Callable[[], torch.Tensor]:
        runner = runners[dtype]
        return lambda: runner.embed([runner.tokenizer.encode(t) for t in texts])

    paths: dict[str, Callable[[], torch.Tensor]] = {
        "sentence-transformers float32": lambda: reference_model.encode(texts, batch_size=BATCH,
                                                                        convert_to_tensor=True),
        "emberserve engine float32": engine("float32"),
        "emberserve engine bfloat16": engine("bfloat16"),
    }
    servers, clients = [], []
    if not args.no_http:
        for dtype in ("float32", "bfloat16"):
            proc, base_url = start_local_server("--model", MODEL, "--dtype", dtype)
            servers.append(proc)
            client = httpx.Client(base_url=base_url, timeout=600)
            clients.append(client)

            def over_http(client: httpx.Client = client) -> torch.Tensor:
                body = client.post("/v1/embeddings", json={"model": MODEL, "input": texts,
                                                           "encoding_format": "base64"}).raise_for_status().json()
                return torch.from_numpy(np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4")
                                                  for d in body["data"]]))
            paths[f"emberserve HTTP {dtype}"] = over_http
    try:
        reference = paths["sentence-transformers float32"]().float()
        cosine = {name: float(torch.nn.functional.cosine_similarity(fn().float(), reference).min())
                  for name, fn in paths.items()}
        for fn in paths.values():  # warm-up
            fn()
        times: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(args.repeats):
            for name, fn in paths.items():
                started = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - started)
    finally:
        for client in clients:
            client.close()
        for proc in servers:
            proc.terminate()
            proc.wait()
    base = statistics.median(times["sentence-transformers float32"])
    rows = [{"path": name, "median_ms": round(1000 * statistics.median(t), 1),
             "embeddings_per_s": round(BATCH / statistics.median(t), 1),
             "speedup_vs_sentence_transformers": round(base / statistics.median(t), 2),
             "min_cosine_vs_sentence_transformers": round(cosine[name], 6)} for name, t in times.items()]
    print("| path | ms per batch of 64 | embeddings/s | vs sentence-transformers | worst cosine |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['path']} | {r['median_ms']} | {r['embeddings_per_s']} | "
              f"{r['speedup_vs_sentence_transformers']}x | {r['min_cosine_vs_sentence_transformers']} |")
    print(json.dumps({
        "model": MODEL, "batch": BATCH, "repeats": args.repeats,
        "tokens": {"min": min(lengths), "mean": round(sum(lengths) / len(lengths), 1), "max": max(lengths)},
        "cpu": _cpu_name(), "torch_threads": torch.get_num_threads(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()], "results": rows}, indent=2))


if __name__ == "__main__":
    main()
