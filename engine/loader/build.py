"""`load_runner`: resolve a model name or path, read its weights and tokenizer, and build a `Runner`."""
from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.config import EncoderConfig, ModelConfig
from engine.errors import ModelFormatError
from engine.cache.kv_cache import kv_bytes_per_token
from engine.loader.experts import place_experts
from engine.model import BertEncoder, DecoderModel, build_model
from engine.model.bert import bert_state_dict
from engine.parallel.layers import parallelize
from engine.parallel.ranks import RankGroup, RankProcesses
from engine.parallel.sharding import Shard, resize_modules, shard_of, shard_state
from engine.runtime.pooling import sentence_transformers_pooling
from engine.model.quant import QUANT_MODES, Affine4Bit, Int8Embedding, Int8Linear, quantize_int8, quantized_linear
from engine.model.quant.dot import Int8DotEmbedding, Int8DotLinear, dense_copies_pay
from engine.registry import KNOWN_MODELS, model_name, model_path
from engine.runtime.runner import Runner
from engine.weights import Progress, no_progress
from engine.weights.gguf import load_gguf
from engine.weights.safetensors import load_safetensors_dir
from engine.weights.summary import chat_tuned, generation_defaults, model_config, model_tokenizer, read_summary

log = logging.getLogger("emberserve.engine")

DEFAULT_CPU_KV_MEMORY = 512 << 20
CPU_POOL_CONTEXTS, GPU_POOL_CONTEXTS = 1, 256
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


def resolve_quant(quant: str | None, dtype: str | torch.dtype | None, device: torch.device,
                  quantized_source: bool) -> tuple[str, torch.dtype]:
    """(quant mode, compute dtype) from what was asked; defaults depend on the device and the weights' source.

    On CPU a quantized (GGUF) model keeps its weights compressed, int4 with bfloat16 activations, unless float32
    was asked for (the exact path); float checkpoints stay as they are unless a quant mode is asked for.
    Accelerators compute in bfloat16 from dense weights unless a quant mode is asked for (CUDA: int4 and int8
    weights with bfloat16 activations, what a draft model of the target is, `--draft-model self-int4`).
    """
    if quant is not None and quant not in QUANT_MODES:
        raise ValueError(f"unsupported quant {quant!r}; use one of {', '.join(QUANT_MODES)}")
    if device.type != "cpu":
        resolved = resolve_dtype(dtype, device)
        if quant in (None, "none"):
            return "none", resolved
        if device.type != "cuda":
            raise ValueError(f"quant {quant!r} runs on CPU and CUDA only; use quant 'none' on {device.type}")
        if resolved != torch.bfloat16:
            raise ValueError(f"quant {quant!r} on CUDA computes in bfloat16, not {resolved}")
        return quant, resolved
    if quant is None:
        wanted = resolve_dtype(dtype, device) if dtype is not None else None
        quant = "int4" if quantized_source and wanted in (None, torch.bfloat16) else "none"
    if dtype is None:
        return quant, torch.bfloat16 if quant != "none" else torch.float32
    resolved = resolve_dtype(dtype, device)
    if quant != "none" and resolved != torch.bfloat16:
        log.warning("quant %s with %s activations uses torch's slow reference kernels; bfloat16 is the fast path",
                    quant, resolved)
    return quant, resolved


def _fuse_projections(state: dict[str, Any], cfg: ModelConfig) -> None:
    """Concatenate q/k/v and gate/up weights (and biases) into the fused projections the decoder runs."""
    fused = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
             "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
             "mlp.shared_expert.gate_up_proj": ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj")}
    for layer in range(cfg.num_layers):
        _fuse_experts(state, f"layers.{layer}.mlp.experts.")
        for target, parts in fused.items():
            for kind in ("weight", "bias"):
                names = [f"layers.{layer}.{p}.{kind}" for p in parts]
                if not all(n in state for n in names):
                    continue
                values = [state.pop(n) for n in names]
                state[f"layers.{layer}.{target}.{kind}"] = (
                    Affine4Bit.cat(values) if all(isinstance(v, Affine4Bit) for v in values)
                    else torch.cat([v.dequantize() if isinstance(v, Affine4Bit) else v for v in values]))


def _fuse_experts(state: dict[str, Any], prefix: str) -> None:
    """The readers' expert stacks (`gate_proj`, `up_proj`, `down_proj` [E, out, in], `*_bias` [E, out]) as the
    decoder's `gate_up` (gate rows, then up rows) and `down` ExpertStacks.

    A stack is a float tensor, a stacked `Affine4Bit` or `Mxfp4Tensor`, or the GGUF reader's `LazyExperts` (read an
    expert at a time: joined lazily here, so the fuse step reads nothing)."""
    for kind, suffix in (("weight", ""), ("bias", "_bias")):
        gate, up, down = (f"{prefix}{p}{suffix}" for p in ("gate_proj", "up_proj", "down_proj"))
        if gate in state and up in state:
            state[f"{prefix}gate_up.{kind}"] = _cat_expert_rows([state.pop(gate), state.pop(up)])
        if down in state:
            state[f"{prefix}down.{kind}"] = state.pop(down)


def _cat_expert_rows(parts: list[Any]) -> Any:
    """Expert stacks [E, out_i, in] (biases [E, out_i]) joined along their output rows, in the parts' own form
    when they share one, else as float tensors."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts, dim=1)
    if all(type(p) is type(parts[0]) for p in parts) and hasattr(parts[0], "cat"):
        return type(parts[0]).cat(parts, dim=1)
    return torch.cat([p if isinstance(p, torch.Tensor) else p.dequantize() for p in parts], dim=1)


def _quantize_modules(model: DecoderModel, state: dict[str, Any], quant: str, dtype: torch.dtype,
                      requantize_floats: bool, progress: Progress, dense_prefill: bool, device: torch.device) -> None:
    """Swap every Linear for its quantized form (the embedding too), taking their weights out of `state`.

    `requantize_floats` False (a GGUF file): float weights there were stored with more than 4 bits, so in int4
    mode they become int8 rather than losing precision; True (a float checkpoint): `quant` applies to all.
    """
    tied_embedding = state["lm_head.weight"] is state["embed_tokens.weight"]
    # A mixture of experts' router (and shared-expert gate) stays in float: its top-k choice flips on small errors.
    linears = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)
               and not name.endswith(("mlp.router", "mlp.shared_expert_gate"))]
    for done, name in enumerate(linears, 1):
        progress(f"packing {quant} weights", done, len(linears))
        weight, bias = state.pop(f"{name}.weight"), state.pop(f"{name}.bias", None)
        mode = quant if requantize_floats or isinstance(weight, Affine4Bit) else "int8"
        # The output projection sees one row per sequence even in prefill: a dense copy would never be used.
        keep_dense = dense_prefill and name != "lm_head"
        model.set_submodule(name, quantized_linear(weight, bias, mode, dtype, keep_dense, device))
    embedding = state.pop("embed_tokens.weight")
    head = model.lm_head
    if tied_embedding and isinstance(head, Int8Linear):  # one int8 table serves the lookup and the output matmul
        model.embed_tokens = Int8Embedding.sharing(head, dtype)
    elif tied_embedding and isinstance(head, Int8DotLinear):
        model.embed_tokens = Int8DotEmbedding(head, dtype)
    else:
        dense = embedding.dequantize() if isinstance(embedding, Affine4Bit) else embedding
        model.embed_tokens = Int8Embedding(*quantize_int8(dense), dtype).to(device)


def _materialise(cfg: ModelConfig, state: dict[str, Any], device: torch.device, dtype: torch.dtype,
                 quant: str, requantize_floats: bool, source: str, progress: Progress,
                 dense_prefill: bool, shard: Shard | None = None) -> DecoderModel:
    with torch.device("meta"):
        model = build_model(cfg)
    if cfg.tie_embeddings or "lm_head.weight" not in state:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    _fuse_projections(state, cfg)
    expected = set(model.state_dict().keys())
    missing, unexpected = expected - state.keys(), state.keys() - expected
    if missing or unexpected:
        raise ModelFormatError(f"{source}: weights do not match the {cfg.family} architecture; "
                               f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    if shard is not None:  # this rank's share of every tensor, in modules of its shapes (engine/parallel/)
        shard_state(state, cfg, shard)
        resize_modules(model, cfg, shard)
    if cfg.moe is not None:
        place_experts(model, state, quant, dtype, device, requantize_floats)
    if quant != "none":
        _quantize_modules(model, state, quant, dtype, requantize_floats, progress, dense_prefill, device)
    converted: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if isinstance(tensor, Affine4Bit):
            tensor = tensor.dequantize()
        # Norms, attention sinks and MoE routers stay float32 (applied in float32); the rest takes the compute dtype.
        target = torch.float32 if name.endswith(("norm.weight", "self_attn.sinks", "mlp.router.weight",
                                                 "mlp.router.bias")) else dtype
        converted[name] = tensor.to(device=device, dtype=target)
    if cfg.tie_embeddings and quant == "none":
        converted["lm_head.weight"] = converted["embed_tokens.weight"]
    # (quantized modules and placed experts hold buffers of other names: checked by `left` below instead)
    model.load_state_dict(converted, assign=True, strict=quant == "none" and cfg.moe is None)
    model.refresh()
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta and n in expected]
    if left:
        raise ModelFormatError(f"{source}: no weights for {left[:5]}")
    return model.eval()


def _materialise_encoder(cfg: EncoderConfig, state: dict[str, torch.Tensor], device: torch.device,
                         dtype: torch.dtype, source: str) -> BertEncoder:
    with torch.device("meta"):
        model = BertEncoder(cfg)
    # The projections and MLPs compute in `dtype`; embeddings, norms and the residual stream between them stay
    # float32: in bfloat16 throughout, rounding the stream costs all-MiniLM-L6-v2 its 0.9999 cosine to float32.
    converted = {name: t.to(device=device, dtype=dtype if name.startswith("layers.") and "proj" in name
                            else torch.float32) for name, t in bert_state_dict(state, cfg).items()}
    expected = set(model.state_dict())
    missing, unexpected = expected - converted.keys(), converted.keys() - expected
    if missing or unexpected:
        raise ModelFormatError(f"{source}: weights do not match the {cfg.family} architecture; "
                               f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    model.load_state_dict(converted, assign=True)
    return model.eval()


def _rebuild_buffers(model: DecoderModel, device: torch.device, dtype: torch.dtype, context: int,
                     freq_factors: torch.Tensor | None) -> None:
    """Recompute the rope buffers that were built on the meta device (with GGUF's llama3 factors, if any), the
    tables for the `context` positions a sequence can reach, in the compute `dtype`."""
    from engine.model.layers import rope_inv_freq

    cfg = model.cfg
    local = rope_inv_freq(cfg.local_rope, cfg.head_dim).to(device) if cfg.local_rope else None
    model.set_rope(rope_inv_freq(cfg.rope, cfg.head_dim, freq_factors).to(device), local, context, dtype)


def _return_freed_memory() -> None:
    """Hand the load's temporaries (float copies of quantized tensors) back to the OS: glibc keeps freed heap
    pages resident otherwise, a few hundred MiB of RSS for nothing."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def kv_cache_tokens(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, context: int,
                    memory: int | None, kv_heads: int | None = None) -> int:
    """How many tokens the KV pool holds: `memory` bytes if given.

    Default: on CPU one full context's worth (at most 512 MiB), on an accelerator 90% of its free memory (at most
    256 contexts): the pool is committed up front, and a small model on a CPU should not need gigabytes.
    """
    per_token = kv_bytes_per_token(cfg, dtype, kv_heads)
    if memory is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            memory = min(int(free * 0.9), GPU_POOL_CONTEXTS * context * per_token)
        else:
            memory = min(DEFAULT_CPU_KV_MEMORY, CPU_POOL_CONTEXTS * context * per_token)
    if memory // per_token < 1:
        raise ValueError(f"kv cache memory of {memory} bytes holds no token ({per_token} bytes per token)")
    return memory // per_token


@dataclass(frozen=True)
class LoadOptions:
    """What `load_runner` was asked to load, as plain data: every rank of a tensor-parallel runner gets a copy."""

    source: str
    device: str = "cpu"
    dtype: str | torch.dtype | None = None
    max_context: int | None = None
    kv_cache_memory: int | None = None
    prefix_caching: bool = True
    quant: str | None = None
    dense_prefill: bool | None = None  # None: where it pays (quant_dot.dense_copies_pay)
    deterministic: bool = False


def _dense_prefill(options: LoadOptions, dtype: torch.dtype) -> bool:
    """Whether packed layers keep their bfloat16 copy: as asked, else where it pays (on CUDA only if asked: a
    quantized model there is a draft, whose point is its memory); never when deterministic."""
    if options.deterministic:
        return False
    if torch.device(options.device).type != "cpu":
        return bool(options.dense_prefill)
    return dense_copies_pay(dtype) if options.dense_prefill is None else options.dense_prefill


def _resolve_source(source: str) -> tuple[Path, Any]:
    """(the model's path, its registry entry or None)."""
    path = model_path(source)
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
        return path, KNOWN_MODELS.get(source)
    raise ModelFormatError(f"{path}: not a model: expected a .gguf file or a safetensors directory")


def read_config(source: str) -> ModelConfig | EncoderConfig:
    """The model's config alone (config.json or GGUF metadata), without reading its weights."""
    path, _ = _resolve_source(source)
    return model_config(path)


def build_runner(options: LoadOptions, progress: Progress = no_progress, rank: RankGroup | None = None,
                 leader: RankProcesses | None = None) -> Runner:
    """The Runner of `options` in this process: the whole model, or with `rank` that rank's share of it (rank 0
    passes `leader`, its handle on the other ranks)."""
    device = torch.device(options.device) if rank is None else rank.device
    dtype, quant, max_context = options.dtype, options.quant, options.max_context
    path, known = _resolve_source(options.source)
    name = model_name(options.source)
    defaults = generation_defaults(path, known)
    freq_factors = None
    if path.is_dir():
        quant, dtype = resolve_quant(quant, dtype, device, quantized_source=False)
        cfg, state, _ = load_safetensors_dir(path, progress)
        # the headers' facts (parameter count, file type, ...) for whoever describes the model; after the load,
        # whose errors name what is wrong with the files
        weights = read_summary(path)
        chat = chat_tuned(weights, known)
        tokenizer = model_tokenizer(path, known)
        if cfg.is_encoder:
            if quant != "none":
                raise ValueError(f"quant {quant!r} is for decoders; a {cfg.family} encoder runs dense weights")
            encoder = _materialise_encoder(cfg, state, device, dtype, str(path))
            _return_freed_memory()
            return Runner(encoder, tokenizer, name=name, device=device, dtype=dtype,
                          max_context=max_context, pooling=sentence_transformers_pooling(path) or "mean",
                          weights=weights, chat_tuned=chat)
    else:
        quant, dtype = resolve_quant(quant, dtype, device, quantized_source=True)
        cfg, state, meta, freq_factors = load_gguf(path, keep_4bit=quant == "int4", progress=progress)
        weights = read_summary(path)
        chat = chat_tuned(weights, known)
        tokenizer = model_tokenizer(path, known, meta)
    shard = shard_of(cfg, rank.rank, rank.size) if rank is not None else None
    model = _materialise(cfg, state, device, dtype, quant, requantize_floats=path.is_dir(), source=str(path),
                        progress=progress, dense_prefill=_dense_prefill(options, dtype),
                        shard=shard)
    _rebuild_buffers(model, device, dtype, max_context or cfg.max_position, freq_factors)
    kv_heads = cfg.num_kv_heads if shard is None else shard.num_kv_heads
    tokens = kv_cache_tokens(cfg, dtype, device, max_context or cfg.max_position, options.kv_cache_memory, kv_heads)
    if rank is not None:
        parallelize(model, cfg, shard, rank.name)
        tokens = _agree_on_pool(tokens, rank)
    _return_freed_memory()
    return Runner(model, tokenizer, name=name, device=device, dtype=dtype, quant=quant,
                  max_context=max_context, generation_defaults=defaults, prefix_caching=options.prefix_caching,
                  deterministic=options.deterministic, kv_cache_tokens=tokens, kv_heads=kv_heads,
                  tensor_parallel=leader, weights=weights, chat_tuned=chat)


def _agree_on_pool(tokens: int, rank: RankGroup) -> int:
    """The smallest pool any rank can hold (GPUs differ in free memory): every rank's pool has the same blocks."""
    count = torch.tensor([tokens], dtype=torch.int64, device=rank.device)
    torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MIN, group=rank.group)
    return int(count.item())
