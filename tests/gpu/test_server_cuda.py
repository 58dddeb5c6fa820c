"""A real `--device cuda` server (skipped without CUDA; run on the GPU machine): 128 concurrent clients with mixed
sampling fields, a fifth of them leaving at random moments (bench/soak.py), then nothing leaked and no 5xx; the
defaults on a GPU (the engine in its own process, async scheduling), without async scheduling, and everything in
the server's process."""
from __future__ import annotations

import asyncio

import pytest
import torch

from bench import soak
from bench.synthetic_model import Shape, write_model_dir
from tests.support.server_process import start_server, stop_server

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
SMALL = Shape("llama", 256, 4, 4, 2, 64, 512, 49152, 10000.0)  # the soak's token ids fit its vocabulary


@pytest.mark.parametrize("flags", [[], ["--no-async-scheduling"], ["--no-engine-process", "--no-async-scheduling"],
                                   ["--api-server-count", "2"]],
                         ids=["default", "no-async-scheduling", "one-process", "two-http-processes"])
def test_a_cuda_server_under_128_clients_leaves_nothing_behind(tmp_path, flags) -> None:
    model = write_model_dir(SMALL, tmp_path / "model", device="cuda")
    srv = start_server(tmp_path, "--model", str(model.path), "--device", "cuda", "--served-model-name", soak.MODEL,
                       "--max-running", "128", "--kv-cache-memory", "2GiB", *flags)
    try:
        result = asyncio.run(soak.soak(srv.base_url, srv.process.pid, requests=600, concurrency=128,
                                       leave_fraction=0.2, max_tokens=48, mark=200, seed=2))
    finally:
        stop_server(srv)
    verdict = soak.checks(result, rss_tolerance=0.05)
    assert verdict["no_5xx"] and verdict["kv_blocks_free"] and verdict["nothing_running"], \
        (verdict, result.failures[:5], result.__dict__["health"])
    assert result.outcomes["ok"] > 300 and result.outcomes["left"] > 60, result.outcomes
    assert "Traceback" not in srv.log(), srv.log()[-3000:]


def test_device_auto_serves_on_the_gpu_and_says_so(tmp_path) -> None:
    """No --device: the default `auto` finds the GPU, the defaults for a GPU follow, and the start-up log says why."""
    import httpx

    model = write_model_dir(SMALL, tmp_path / "model", device="cuda")
    srv = start_server(tmp_path, "--model", str(model.path), "--served-model-name", soak.MODEL)
    try:
        health = httpx.get(f"{srv.base_url}/health", timeout=10).json()
        answer = httpx.post(f"{srv.base_url}/v1/completions", timeout=60,
                            json={"model": soak.MODEL, "prompt": [1, 2, 3], "max_tokens": 4}).json()
    finally:
        stop_server(srv)
    assert health["device"].startswith("cuda"), health
    assert "on cuda (--device auto: a CUDA GPU is present)" in srv.log()
    assert "the engine runs in process" in srv.log()  # a GPU's default: the engine in a process of its own
    assert answer["usage"]["completion_tokens"] == 4, answer
