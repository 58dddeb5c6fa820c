"""`load_runner`: resolve a model name or path, read its weights and tokenizer, and build a `Runner`."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from .config import ModelConfig
from .errors import ModelFormatError
from .kv_cache import kv_bytes_per_token
from .models import DecoderModel, build_model
from .registry import KNOWN_MODELS
from .runner import Runner
from .tokenizer import Tokenizer
from .weights.gguf import load_gguf
from .weights.safetensors import load_safetensors_dir

DEFAULT_CPU_KV_MEMORY = 512 << 20
CPU_POOL_CONTEXTS, GPU_POOL_CONTEXTS = 4, 256
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """float32 on CPU and bfloat16 on accelerators unless asked otherwise."""
    if dtype is None:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[dtype.lower()]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {', '.join(_DTYPES)}") from None


def _materialise(cfg: ModelConfig, state: dict[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype, source: str) -> DecoderModel:
    with torch.device("meta"):
        model = build_model(cfg)
    if cfg.tie_embeddings or "lm_head.weight" not in state:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    expected = set(model.state_dict().keys())
    missing, unexpected = expected - state.keys(), state.keys() - expected
    if missing or unexpected:
        raise ModelFormatError(f"{source}: weights do not match the {cfg.family} architecture; "
                               f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    converted: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        # Norms stay float32 (they are applied in float32); everything else takes the compute dtype.
        target = torch.float32 if name.endswith("norm.weight") else dtype
        converted[name] = tensor.to(device=device, dtype=target)
    if cfg.tie_embeddings:
        converted["lm_head.weight"] = converted["embed_tokens.weight"]
    model.load_state_dict(converted, assign=True)
    return model.eval()


def _rebuild_buffers(model: DecoderModel, device: torch.device, freq_factors: torch.Tensor | None) -> None:
    """Recompute the rope buffers that were built on the meta device (with GGUF's llama3 factors, if any)."""
    from .layers import rope_inv_freq

    cfg = model.cfg
    model.inv_freq = rope_inv_freq(cfg.rope, cfg.head_dim, freq_factors).to(device)
    model.local_inv_freq = rope_inv_freq(cfg.local_rope, cfg.head_dim).to(device) if cfg.local_rope else None


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def kv_cache_tokens(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, context: int,
                    memory: int | None) -> int:
    """How many tokens the KV pool holds: `memory` bytes if given.

    Default: on CPU 512 MiB, on an accelerator 90% of its free memory; either way no more than a few full
    contexts' worth (a tiny model needs no gigabytes), since the pool is committed up front.
    """
    per_token = kv_bytes_per_token(cfg, dtype)
    if memory is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            memory = min(int(free * 0.9), GPU_POOL_CONTEXTS * context * per_token)
        else:
            memory = min(DEFAULT_CPU_KV_MEMORY, CPU_POOL_CONTEXTS * context * per_token)
    if memory // per_token < 1:
        raise ValueError(f"kv cache memory of {memory} bytes holds no token ({per_token} bytes per token)")
    return memory // per_token


def load_runner(source: str | os.PathLike[str], device: str | torch.device = "cpu",
                dtype: str | torch.dtype | None = None, max_context: int | None = None,
                kv_cache_memory: int | None = None, prefix_caching: bool = True) -> Runner:
    """A ready Runner for a known model name, a .gguf file, or a safetensors directory.

    `kv_cache_memory` (bytes) sizes the paged KV pool; `prefix_caching` lets prompts reuse cached prefixes.
    """
    device = torch.device(device)
    dtype = resolve_dtype(dtype, device)
    name, defaults, template = str(source), {}, None
    known = KNOWN_MODELS.get(str(source))
    if known is not None:
        path, defaults, template = known.path(), dict(known.generation_defaults), known.chat_template
    else:
        path = Path(source)
    freq_factors = None
    if path.is_dir():
        cfg, state, _ = load_safetensors_dir(path)
        tokenizer = Tokenizer.from_pretrained_dir(path)
        gen = _read_json(path / "generation_config.json")
        defaults |= {k: gen[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty") if k in gen}
    elif path.is_file() and path.suffix == ".gguf":
        cfg, state, meta, freq_factors = load_gguf(path)
        tokenizer = Tokenizer.from_gguf_metadata(meta)
    elif path.exists():
        raise ModelFormatError(f"{path}: not a model: expected a .gguf file or a safetensors directory")
    else:
        raise ModelFormatError(f"model not found: {source!r} is neither a known model name "
                               f"({', '.join(KNOWN_MODELS)}) nor an existing path")
    if template is not None:
        tokenizer.set_chat_template(template)
    model = _materialise(cfg, state, device, dtype, str(path))
    _rebuild_buffers(model, device, freq_factors)
    context = max_context or cfg.max_position
    return Runner(model, tokenizer, name=name if known else path.name, device=device, dtype=dtype,
                  max_context=max_context, generation_defaults=defaults, prefix_caching=prefix_caching,
                  kv_cache_tokens=kv_cache_tokens(cfg, dtype, device, context, kv_cache_memory))
