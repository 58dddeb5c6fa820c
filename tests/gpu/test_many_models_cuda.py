"""Several models in one server on a GPU (skipped without CUDA; run on the GPU machine): two random models of a
real shape, each in an engine process of its own on the GPU, loaded on demand; with --max-loaded-models 1 the
idle one is unloaded for the other, and its GPU memory is given back."""
from __future__ import annotations

import subprocess

import httpx
import pytest
import torch

from bench.synthetic_model import Shape, write_model_dir
from tests.support.server_process import start_server, stop_server

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
SMALL = Shape("llama", 256, 4, 4, 2, 64, 512, 49152, 10000.0)


def gpu_memory_used_mib() -> int:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return int(out.split()[0])


def states(base_url: str) -> dict[str, str]:
    return {m["id"]: m["state"] for m in httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"]}


def test_two_models_on_a_gpu_load_on_demand_and_the_idle_one_gives_its_memory_back(tmp_path) -> None:
    first = write_model_dir(SMALL, tmp_path / "first", device="cuda")
    second = write_model_dir(SMALL, tmp_path / "second", device="cuda")
    before = gpu_memory_used_mib()
    srv = start_server(tmp_path, "--model", str(first.path), "--model", str(second.path), "--max-loaded-models", "1",
                       "--kv-cache-memory", "2GiB")
    try:
        assert states(srv.base_url) == {"first": "loaded", "second": "unloaded"}
        one = gpu_memory_used_mib()

        def complete(model: str) -> dict:
            return httpx.post(f"{srv.base_url}/v1/completions", timeout=300,
                              json={"model": model, "prompt": [1, 2, 3], "max_tokens": 8}).json()

        assert complete("first")["usage"]["completion_tokens"] == 8
        assert complete("second")["usage"]["completion_tokens"] == 8  # loads it, unloading the idle first
        assert states(srv.base_url) == {"first": "unloaded", "second": "loaded"}
        swapped = gpu_memory_used_mib()
    finally:
        stop_server(srv)
    assert "Traceback" not in srv.log(), srv.log()[-3000:]
    loaded = one - before
    assert loaded > 0 and abs(swapped - one) <= 0.1 * loaded + 64, (before, one, swapped)  # one model's worth, not two
