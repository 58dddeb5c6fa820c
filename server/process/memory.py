"""Memory for the multi-model server (server/process/model_manager.py): the budget the loaded models share, a
model's KV cache within its share of it, its weights' size, and what its engine process tree takes once it has
loaded (`tree_rss`)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from engine.cache.kv_cache import kv_bytes_per_token
from engine.loader.build import kv_cache_tokens, read_config, resolve_quant
from engine.registry import model_path
from engine.weights.summary import read_summary

from server.config.settings import Settings

BUDGET_SHARE = 0.9  # of the memory there is, as the engine leaves a tenth of a GPU's free memory to others
# The least KV cache a model gets when its share of the budget, less its weights, comes to less: a small pool
# that serves a few sequences, rather than a refusal decided before the model's real size is known.
MIN_KV_CACHE = 64 << 20


def available_memory() -> int:
    """This machine's available memory (MemAvailable: free pages and what the kernel can reclaim), in bytes."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def gpu_memory(device: str) -> int:
    """The GPU's total memory in bytes, asked of torch in a process of its own: in this one, CUDA would keep a
    context (and its memory on the GPU) for as long as the server runs."""
    probe = f"import torch; print(torch.cuda.get_device_properties(torch.device({device!r})).total_memory)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ValueError(f"cannot read the memory of {device} ({last}): set --memory-budget")
    return int(done.stdout)


def memory_budget(settings: Settings) -> int:
    """--memory-budget, else a share of the memory there is: the machine's available memory on CPU, the GPU's on
    CUDA (the loaded models' weights and KV caches live there)."""
    if settings.memory_budget is not None:
        return settings.memory_budget
    return int(BUDGET_SHARE * (gpu_memory(settings.device) if settings.device.startswith("cuda")
                               else available_memory()))


def weights_size(source: str) -> int:
    """A model's weights on disk, in bytes (from its files' headers: nothing is loaded)."""
    return read_summary(model_path(source)).size_bytes


def kv_cache_memory(settings: Settings, source: str, share: int, weights: int) -> int | None:
    """A model's KV-cache memory: --kv-cache-memory, else the engine's default on CPU (one context, at most
    DEFAULT_CPU_KV_MEMORY), at most its share of the budget less its weights (and at least MIN_KV_CACHE); on a GPU,
    where the engine's default is most of its free memory, that share. None for an encoder, which has no KV cache."""
    cfg = read_config(source)
    if cfg.is_encoder:
        return None
    if settings.kv_cache_memory is not None:
        return settings.kv_cache_memory
    room = max(share - weights, MIN_KV_CACHE)
    if settings.device != "cpu":
        return room
    cpu = torch.device("cpu")
    _, dtype = resolve_quant(settings.quant, settings.dtype, cpu, quantized_source=not model_path(source).is_dir())
    context = settings.max_model_len or cfg.max_position
    default = kv_cache_tokens(cfg, dtype, cpu, context, None) * kv_bytes_per_token(cfg, dtype)
    return min(room, default)


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(p) for p in (task / "children").read_text().split()]
        except OSError:  # a thread that ended meanwhile
            pass
    return found


def tree_rss(pid: int) -> int:
    """The resident memory of process `pid` and all its descendants, in bytes (0 for one that is gone)."""
    total, pending = 0, [pid]
    while pending:
        current = pending.pop()
        try:
            for line in Path(f"/proc/{current}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
                    break
        except OSError:
            continue
        pending += _children(current)
    return total
