"""How much anonymous memory loading a GGUF takes, measured in a fresh process (a test's own process keeps freed
heap that later allocations reuse, which would hide growth):

    python -m tests.support.memory_probe MODEL.gguf MODE [WARM.gguf]   # prints {"peak": bytes, "final": bytes, ...}

Anonymous memory (the kernel's RssAnon: the heap, torch's tensors) is what a load costs; the file's pages that a
memory map brings in are the page cache's, shared and dropped under pressure, so they are not counted. A thread
samples RssAnon every millisecond from just before the load; `peak` and `final` are growths over that baseline.

Modes: `read` (load_gguf with 4-bit codes kept, every expert then read once and dropped), `float` (load_gguf, every
expert stack materialised as bfloat16 and kept), `runner` (load_runner, int4 weights, bfloat16 activations). A runner's
first load also pays once for what any model needs (compiled kernels, the scripted stack, thread pools): with
WARM.gguf (a small model of the same architecture), that one is loaded and dropped before the baseline.
"""
from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path


def rss_anon() -> int:
    """This process's anonymous resident memory in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


class PeakSampler:
    """Samples RssAnon in a thread until stopped; `peak` is the largest sample."""

    def __init__(self, every_s: float = 0.001) -> None:
        self.every_s, self.peak, self._stop = every_s, rss_anon(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_anon())
            time.sleep(self.every_s)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_anon())


def main(path: str, mode: str, warm: str | None = None) -> dict:
    import torch

    from engine import load_runner
    from engine.weights.gguf import load_gguf
    from engine.weights.lazy_experts import LazyExperts

    torch.set_num_threads(1)
    runner_options = dict(dtype="bfloat16", quant="int4", max_context=64, kv_cache_memory=1 << 20)
    if warm is not None:
        load_runner(warm, **runner_options).close()
    kept: list = []
    base = rss_anon()
    with PeakSampler() as sampler:
        if mode == "runner":
            kept.append(load_runner(path, **runner_options))
        else:
            _, state, _, _ = load_gguf(path, keep_4bit=mode == "read")
            kept.append(state)
            for stack in [v for v in state.values() if isinstance(v, LazyExperts)]:
                if mode == "read":
                    for expert in stack:
                        del expert
                else:
                    kept.append(stack.to(dtype=torch.bfloat16))
    expert_weights = sum(s.numel() for s in kept[1:]) if mode == "float" else 0
    return {"peak": sampler.peak - base, "final": rss_anon() - base, "expert_weights": expert_weights}


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:4])))
