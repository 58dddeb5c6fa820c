"""`load_runner`: a ready Runner in this process, or rank 0 of one split over several (tensor parallelism)."""
from __future__ import annotations

import os

import torch

from engine.errors import UnsupportedModelError
from engine.loader.build import LoadOptions, build_runner, read_config
from engine.loader.devices import check_device
from engine.loader.tensor_parallel import launch_ranks
from engine.parallel.sharding import check_shardable
from engine.runtime.runner import Runner
from engine.weights import Progress, no_progress


def load_runner(source: str | os.PathLike[str], device: str | torch.device = "cpu",
                dtype: str | torch.dtype | None = None, max_context: int | None = None,
                kv_cache_memory: int | None = None, prefix_caching: bool = True,
                quant: str | None = None, progress: Progress = no_progress, dense_prefill: bool | None = None,
                deterministic: bool = False, tensor_parallel_size: int = 1) -> Runner:
    """A ready Runner for a known model name, a .gguf file, or a safetensors directory.

    `kv_cache_memory` (bytes) sizes the paged KV pool; `prefix_caching` lets prompts reuse cached prefixes;
    `quant` ("none", "int8", "int4"; default per device and source, see `resolve_quant`) keeps weights compressed;
    `progress(stage, done, total)` is told as tensors are read and packed; `dense_prefill` keeps a bfloat16 copy
    of quantized layer weights for calls of many rows (prefill), for 2 bytes per weight more (None: where that is
    faster than the packed kernels, `quant_dot.dense_copies_pay`);
    `deterministic` sends every token through the same kernels (CPU only), so that logits do not depend on
    chunking, batching or the prefix cache (no dense copy is kept then: it would never be used).
    `tensor_parallel_size` N > 1 splits every layer over N processes (engine/parallel/): this one is rank 0 and
    spawns the others (one GPU each from `device` on; on CPU they share the cores); the KV memory is per rank.
    The runner's `close()` stops them. One tensor-parallel runner per process at a time.
    A BERT directory gives an encoder's Runner (embeddings only, no KV cache; pooling from its
    sentence-transformers config); the cache and quant arguments are for decoders.
    """
    check_device(str(device))
    options = LoadOptions(str(source), str(device), dtype, max_context, kv_cache_memory, prefix_caching, quant,
                          dense_prefill, deterministic)
    if tensor_parallel_size == 1:
        return build_runner(options, progress)
    cfg = read_config(options.source)
    if cfg.is_encoder:
        raise UnsupportedModelError(f"tensor parallelism is for decoders; {cfg.family} encoders run in one process")
    check_shardable(cfg, tensor_parallel_size)
    return launch_ranks(options, tensor_parallel_size, progress)
