"""Random-weight models at real shapes, written as a Hugging Face hub directory that `engine.load_runner` reads.

    shape = SHAPES["llama-1b"]
    info = write_model_dir(shape, Path("/dev/shm/llama-1b"), device="cuda")   # config.json, model.safetensors,
                                                                                 # tokenizer.json, tokenizer_config.json
The GPU machine has neither model files nor a network: the weights are drawn on `device` in bfloat16 and saved
straight from torch (safetensors.torch.save_file); the tokenizer is a byte-level BPE over synthetic words whose
vocabulary is exactly the model's, every id decoding to visible text (" w123"), so streamed tokens are chunks.

Mixture-of-experts shapes (qwen3_moe, gpt_oss) are written as their Hub checkpoints are: qwen3_moe one tensor per
expert and projection, gpt_oss stacked `gate_up_proj` [E, H, 2I] (gate and up interleaved column by column) and
`down_proj` [E, I, H], or, with `Shape.mxfp4`, the `*_blocks` / `*_scales` tensors of the real MXFP4 checkpoint.
Tensors are drawn on the device one at a time (an expert at a time) and written in shards as they come, so a model
larger than the host's free memory or twice the device's (the 61 GB qwen3-30b-a3b) never exists twice.

    python bench/synthetic_model.py qwen3-moe-cpu /dev/shm/qwen3-moe-cpu        # one directory from the command line
"""
from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|pad|>")  # ids 0, 1, 2
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
MAX_POSITION = 4096
SHARD_BYTES = 4 << 30  # a shard is written (and its host memory freed) once it holds this much
MXFP4_BLOCK = 32  # values per shared E8M0 scale; two 4-bit values a byte


@dataclass(frozen=True)
class Shape:
    """A decoder's dimensions; `family` is the config.json model_type.

    Mixture of experts: `experts` routed experts per layer, `top_k` of them per token, each a gated FFN of
    `expert_ffn` (`ffn` is then only config.json's intermediate_size). `tied`: the LM head is the embedding.
    `mxfp4`: gpt_oss experts stored as the real checkpoint stores them (4-bit blocks, one scale per 32 values).
    """

    family: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    rope_theta: float
    sliding_window: int = 0  # gemma3: every 6th layer global, the rest sliding; gpt_oss: every other layer sliding
    experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0
    tied: bool = True
    mxfp4: bool = False
    max_position: int = MAX_POSITION

    @property
    def qk_norm(self) -> bool:
        return self.family in ("qwen3", "gemma3_text", "qwen3_moe")

    @property
    def gemma(self) -> bool:
        return self.family == "gemma3_text"

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def gpt_oss(self) -> bool:
        return self.family == "gpt_oss"


def _qwen3_moe(hidden: int, layers: int, heads: int, kv_heads: int, experts: int, top_k: int, expert_ffn: int,
               vocab: int, head_dim: int = 128, max_position: int = MAX_POSITION) -> Shape:
    return Shape("qwen3_moe", hidden, layers, heads, kv_heads, head_dim, top_k * expert_ffn, vocab, 1_000_000.0,
                 experts=experts, top_k=top_k, expert_ffn=expert_ffn, tied=False, max_position=max_position)


def _gpt_oss(hidden: int, layers: int, heads: int, kv_heads: int, experts: int, top_k: int, vocab: int,
             head_dim: int = 64, window: int = 128, mxfp4: bool = False, max_position: int = 131072) -> Shape:
    return Shape("gpt_oss", hidden, layers, heads, kv_heads, head_dim, hidden, vocab, 150_000.0, sliding_window=window,
                 experts=experts, top_k=top_k, expert_ffn=hidden, tied=False, mxfp4=mxfp4, max_position=max_position)


def dense_of_active(shape: Shape) -> Shape:
    """The dense decoder with `shape`'s attention and an FFN as wide as its active experts (top_k * expert_ffn):
    the same matrices read per token. gpt_oss maps to llama (no sinks, biases or sliding window: at the benchmarks'
    short contexts the same matmuls)."""
    family = {"qwen3_moe": "qwen3", "gpt_oss": "llama"}[shape.family]
    return replace(shape, family=family, ffn=shape.top_k * shape.expert_ffn, experts=0, top_k=0, expert_ffn=0,
                   sliding_window=0, mxfp4=False, max_position=MAX_POSITION)


_QWEN3_MOE_CPU = _qwen3_moe(1024, 8, 16, 4, 8, 2, 1536, 49152, head_dim=64)
_GPT_OSS_CPU = _gpt_oss(1024, 8, 16, 4, 8, 2, 49152)

SHAPES = {
    "llama-1b": Shape("llama", 2048, 16, 32, 8, 64, 8192, 49152, 500000.0),
    "llama-8b": Shape("llama", 4096, 32, 32, 8, 128, 14336, 49152, 500000.0),
    "qwen3-0.6b": Shape("qwen3", 1024, 28, 16, 8, 128, 3072, 151936, 1000000.0),
    "gemma3-1b": Shape("gemma3_text", 1152, 26, 4, 1, 256, 6912, 262144, 1000000.0, sliding_window=512),
    "tiny": Shape("llama", 64, 2, 4, 2, 16, 128, 512, 10000.0),
    "tiny-gemma3": Shape("gemma3_text", 64, 7, 4, 1, 32, 128, 512, 1000000.0, sliding_window=16),
    # Qwen3-30B-A3B (its real vocabulary; intermediate_size 6144 as its config.json, unused: every layer is sparse);
    # "qwen3-30b-a3b@12" (shape_by_name) is it with 12 of its 48 layers
    "qwen3-30b-a3b": _qwen3_moe(2048, 48, 32, 4, 128, 8, 768, 151936, max_position=40960),
    # gpt-oss-20b (real vocabulary 201088), experts in bfloat16, or in MXFP4 as the published checkpoint has them
    "gpt-oss-20b": _gpt_oss(2880, 24, 64, 8, 32, 4, 201088),
    "gpt-oss-20b-mxfp4": _gpt_oss(2880, 24, 64, 8, 32, 4, 201088, mxfp4=True),
    # two CPU cores: 8 experts of top 2 at hidden 1024, and the dense models of the same active parameters
    "qwen3-moe-cpu": _QWEN3_MOE_CPU,
    "dense-active-qwen3moe-cpu": dense_of_active(_QWEN3_MOE_CPU),
    "gpt-oss-cpu": _GPT_OSS_CPU,
    "gpt-oss-cpu-mxfp4": replace(_GPT_OSS_CPU, mxfp4=True),
    "dense-active-gptoss-cpu": dense_of_active(_GPT_OSS_CPU),
    # tests and dry runs (gpt_oss dims multiples of 32: MXFP4 blocks)
    "tiny-qwen3-moe": _qwen3_moe(64, 2, 4, 2, 4, 2, 32, 512, head_dim=16),
    "tiny-gpt-oss": _gpt_oss(64, 2, 4, 2, 4, 2, 512, head_dim=16, window=8, max_position=MAX_POSITION),
    "tiny-gpt-oss-mxfp4": _gpt_oss(64, 2, 4, 2, 4, 2, 512, head_dim=16, window=8, mxfp4=True,
                                   max_position=MAX_POSITION),
}


def layer_is_sliding(shape: Shape) -> list[bool]:
    if shape.gpt_oss:  # layer_types: sliding_attention, full_attention, sliding_attention, ...
        return [i % 2 == 0 for i in range(shape.layers)]
    return [bool(shape.sliding_window) and (i + 1) % 6 != 0 for i in range(shape.layers)]


# ---- sizes ---------------------------------------------------------------------------------------------------

def _attention_params(shape: Shape) -> int:
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    params = shape.hidden * (2 * q + 2 * kv)
    if shape.gpt_oss:  # q/k/v/o biases and the sinks
        params += q + 2 * kv + shape.hidden + shape.heads
    return params


def expert_bytes(shape: Shape) -> int:
    """Bytes of one expert's weights (gate, up, down and, for gpt_oss, their biases in bfloat16)."""
    weights = 3 * shape.hidden * shape.expert_ffn
    nbytes = weights * (1 + MXFP4_BLOCK // 2) // MXFP4_BLOCK if shape.mxfp4 else 2 * weights
    return nbytes + (2 * (2 * shape.expert_ffn + shape.hidden) if shape.gpt_oss else 0)


def _shared_layer_bytes(shape: Shape) -> int:
    """Per layer, what every token reads: attention, norms, the router (or the dense FFN)."""
    norms = (4 if shape.gemma else 2) * shape.hidden + (2 * shape.head_dim if shape.qk_norm else 0)
    params = _attention_params(shape) + norms
    if shape.moe:
        params += shape.experts * shape.hidden + (shape.experts if shape.gpt_oss else 0)
    else:
        params += 3 * shape.hidden * shape.ffn
    return 2 * params


def estimated_weight_bytes(shape: Shape) -> int:
    """Bytes of every tensor as written (bfloat16, MXFP4 experts packed): the model's size."""
    embeddings = (1 if shape.tied else 2) * shape.vocab * shape.hidden * 2
    experts = shape.layers * shape.experts * expert_bytes(shape)
    return embeddings + shape.layers * _shared_layer_bytes(shape) + experts + 2 * shape.hidden


def expected_experts_read(shape: Shape, batch: int) -> float:
    """Distinct experts per layer that a decode step of `batch` tokens reads, routing uniform at random (as random
    weights route): each token picks top_k of E, so an expert is missed by all with probability (1 - k/E)^batch."""
    return shape.experts * (1.0 - (1.0 - shape.top_k / shape.experts) ** batch) if shape.moe else 0.0


def active_weight_bytes(shape: Shape, batch: int = 1) -> float:
    """Bytes one decode step of `batch` tokens must read at least: per layer the attention, norms and router plus
    the experts routed to (at batch 1 exactly top_k), then the LM head and `batch` embedding rows. The roofline of
    a step is bandwidth / this. A dense shape reads all of its layers (the tied embedding once, as the head)."""
    head = shape.vocab * shape.hidden * 2
    rows = 0 if shape.tied else batch * shape.hidden * 2
    experts = shape.layers * expected_experts_read(shape, batch) * expert_bytes(shape)
    return shape.layers * _shared_layer_bytes(shape) + experts + head + rows + 2 * shape.hidden


def roofline_tokens_per_s(shape: Shape, bandwidth_gb_s: float, batch: int = 1) -> float:
    return batch * bandwidth_gb_s * 1e9 / active_weight_bytes(shape, batch)


# ---- config.json ---------------------------------------------------------------------------------------------

def hf_config(shape: Shape) -> dict[str, Any]:
    """config.json in the Hugging Face format `engine.config.config_from_hf` reads (the MoE families' keys as the
    published Qwen3-30B-A3B and gpt-oss-20b config.json files spell them)."""
    cfg: dict[str, Any] = {
        "model_type": shape.family, "hidden_size": shape.hidden, "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim,
        "intermediate_size": shape.ffn, "vocab_size": shape.vocab, "max_position_embeddings": shape.max_position,
        "rope_theta": shape.rope_theta, "rms_norm_eps": 1e-6, "tie_word_embeddings": shape.tied,
        "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
    }
    if shape.gemma:
        cfg |= {"architectures": ["Gemma3ForCausalLM"], "hidden_activation": "gelu_pytorch_tanh",
                "sliding_window": shape.sliding_window, "rope_local_base_freq": 10000.0,
                "query_pre_attn_scalar": shape.head_dim, "final_logit_softcapping": None,
                "layer_types": ["sliding_attention" if s else "full_attention" for s in layer_is_sliding(shape)]}
    elif shape.family == "qwen3_moe":
        cfg |= {"architectures": ["Qwen3MoeForCausalLM"], "hidden_act": "silu", "attention_bias": False,
                "num_experts": shape.experts, "num_experts_per_tok": shape.top_k,
                "moe_intermediate_size": shape.expert_ffn, "norm_topk_prob": True, "decoder_sparse_step": 1,
                "mlp_only_layers": [], "use_sliding_window": False, "sliding_window": None,
                "max_window_layers": shape.layers, "rope_scaling": None, "router_aux_loss_coef": 0.001}
    elif shape.gpt_oss:
        cfg |= {"architectures": ["GptOssForCausalLM"], "hidden_act": "silu", "attention_bias": True,
                "rms_norm_eps": 1e-5, "num_local_experts": shape.experts, "num_experts_per_tok": shape.top_k,
                "experts_per_token": shape.top_k, "sliding_window": shape.sliding_window,
                "layer_types": ["sliding_attention" if s else "full_attention" for s in layer_is_sliding(shape)],
                "initial_context_length": 4096, "swiglu_limit": 7.0, "router_aux_loss_coef": 0.9,
                "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                 "beta_slow": 1.0, "original_max_position_embeddings": 4096, "truncate": False}}
        if shape.mxfp4:
            cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
                "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    else:
        cfg |= {"architectures": ["LlamaForCausalLM" if shape.family == "llama" else "Qwen3ForCausalLM"],
                "hidden_act": "silu"}
    return cfg


# ---- weights -------------------------------------------------------------------------------------------------

class _Draw:
    """bfloat16 tensors drawn on `device` from one seeded generator."""

    def __init__(self, device: str | torch.device, seed: int) -> None:
        self.device = device
        self.gen = torch.Generator(device=device).manual_seed(seed)

    def normal(self, *size: int, std: float) -> torch.Tensor:
        return torch.randn(size, generator=self.gen, device=self.device, dtype=torch.bfloat16).mul_(std)

    def matrix(self, rows: int, cols: int, gain: float = 1.0) -> torch.Tensor:
        """[rows, cols] ~ N(0, gain^2 / cols): unit-variance outputs for unit-variance inputs."""
        return self.normal(rows, cols, std=gain / math.sqrt(cols))

    def mxfp4(self, experts: int, rows: int, cols: int, gain: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Random MXFP4 blocks [E, rows, cols/32, 16] (every 4-bit code equally likely) and E8M0 scales
        [E, rows, cols/32]: 2^(scale - 127), chosen so that each row has about the matrix()'s spread
        (the 16 FP4 values' root mean square is about 2.9)."""
        blocks = torch.randint(0, 256, (experts, rows, cols // MXFP4_BLOCK, MXFP4_BLOCK // 2), generator=self.gen,
                               device=self.device, dtype=torch.uint8)
        exponent = round(math.log2(gain / math.sqrt(cols) / 2.9)) + 127
        scales = torch.randint(exponent - 1, exponent + 1, (experts, rows, cols // MXFP4_BLOCK), generator=self.gen,
                               device=self.device, dtype=torch.uint8)
        return blocks, scales


def iter_weights(shape: Shape, device: str | torch.device, seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named bfloat16 tensors on `device`, one at a time: matrices ~ N(0, 1/fan_in) (residual outputs smaller,
    so 48 layers stay finite), norms 1 (gemma stores w of 1 + w: 0), the embedding small, biases small."""
    d = _Draw(device, seed)

    def norm(dim: int) -> torch.Tensor:
        return torch.full((dim,), 0.0 if shape.gemma else 1.0, device=device, dtype=torch.bfloat16)

    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    residual = 0.5 / math.sqrt(shape.layers)
    yield "model.embed_tokens.weight", d.matrix(shape.vocab, h, math.sqrt(h) * 0.02)
    yield "model.norm.weight", norm(h)
    if not shape.tied:
        yield "lm_head.weight", d.matrix(shape.vocab, h)
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        yield p + "self_attn.q_proj.weight", d.matrix(q, h)
        yield p + "self_attn.k_proj.weight", d.matrix(kv, h)
        yield p + "self_attn.v_proj.weight", d.matrix(kv, h)
        yield p + "self_attn.o_proj.weight", d.matrix(h, q, residual)
        if shape.gpt_oss:
            for name, dim in (("q_proj", q), ("k_proj", kv), ("v_proj", kv), ("o_proj", h)):
                yield p + f"self_attn.{name}.bias", d.normal(dim, std=0.02)
            yield p + "self_attn.sinks", d.normal(shape.heads, std=1.0)
        if shape.moe:
            yield from _expert_weights(shape, d, p, residual)
        else:
            yield p + "mlp.gate_proj.weight", d.matrix(shape.ffn, h)
            yield p + "mlp.up_proj.weight", d.matrix(shape.ffn, h)
            yield p + "mlp.down_proj.weight", d.matrix(h, shape.ffn, residual)
        yield p + "input_layernorm.weight", norm(h)
        yield p + "post_attention_layernorm.weight", norm(h)
        if shape.qk_norm:
            yield p + "self_attn.q_norm.weight", norm(shape.head_dim)
            yield p + "self_attn.k_norm.weight", norm(shape.head_dim)
        if shape.gemma:
            yield p + "pre_feedforward_layernorm.weight", norm(h)
            yield p + "post_feedforward_layernorm.weight", norm(h)


def _expert_weights(shape: Shape, d: _Draw, p: str, residual: float) -> Iterator[tuple[str, torch.Tensor]]:
    h, e, i = shape.hidden, shape.experts, shape.expert_ffn
    if shape.family == "qwen3_moe":
        yield p + "mlp.gate.weight", d.matrix(e, h)
        for x in range(e):  # an expert at a time: never the whole layer's experts on the device
            yield p + f"mlp.experts.{x}.gate_proj.weight", d.matrix(i, h)
            yield p + f"mlp.experts.{x}.up_proj.weight", d.matrix(i, h)
            yield p + f"mlp.experts.{x}.down_proj.weight", d.matrix(h, i, residual)
        return
    # gpt_oss: stacked experts; bf16 [E, in, out] (x @ W), MXFP4 [E, out, in/32, 16] (rows: gate/up interleaved)
    yield p + "mlp.router.weight", d.matrix(e, h)
    yield p + "mlp.router.bias", d.normal(e, std=0.02)
    if shape.mxfp4:
        blocks, scales = d.mxfp4(e, 2 * i, h)
        yield p + "mlp.experts.gate_up_proj_blocks", blocks
        yield p + "mlp.experts.gate_up_proj_scales", scales
        blocks, scales = d.mxfp4(e, h, i, residual)
        yield p + "mlp.experts.down_proj_blocks", blocks
        yield p + "mlp.experts.down_proj_scales", scales
    else:
        yield p + "mlp.experts.gate_up_proj", torch.stack([d.matrix(2 * i, h).t() for _ in range(e)])
        yield p + "mlp.experts.down_proj", torch.stack([d.matrix(h, i, residual).t() for _ in range(e)])
    yield p + "mlp.experts.gate_up_proj_bias", d.normal(e, 2 * i, std=0.02)
    yield p + "mlp.experts.down_proj_bias", d.normal(e, h, std=0.02)


def random_weights(shape: Shape, device: str | torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor of `iter_weights` at once (small shapes; write_model_dir streams)."""
    return dict(iter_weights(shape, device, seed))


# ---- tokenizer and directory ---------------------------------------------------------------------------------

def synthetic_tokenizer(vocab_size: int) -> Tokenizer:
    """Byte-level BPE: the special tokens, the 256 byte symbols (any text encodes), then words " w0", " w1", ...
    up to exactly `vocab_size` ids. No merges: text encodes to bytes; ids decode to their words."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for symbol in alphabet:
        vocab[symbol] = len(vocab)
    if vocab_size < len(vocab):
        raise ValueError(f"a vocabulary of {vocab_size} cannot hold the {len(vocab)} special and byte tokens")
    for i in range(vocab_size - len(vocab)):
        vocab[f"Ġw{i}"] = len(vocab)  # Ġ: the byte-level spelling of a space
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


@dataclass(frozen=True)
class ModelDir:
    path: Path
    params: int  # stored values (an MXFP4 byte of blocks counts two, a scale byte one)
    weight_bytes: int  # what one decode step reads of a dense model: every tensor once (the tied embedding as the head)
    active_bytes: float = 0.0  # what one decode step at batch 1 must read (active_weight_bytes)


def write_model_dir(shape: Shape, path: Path, device: str | torch.device, seed: int = 0,
                    shard_bytes: int = SHARD_BYTES) -> ModelDir:
    """Write config.json, the safetensors (one model.safetensors, or shards and their index past `shard_bytes`)
    and the tokenizer files of `shape` under `path`, drawing and saving tensor by tensor."""
    path.mkdir(parents=True, exist_ok=True)
    for old in path.glob("model*.safetensors*"):
        old.unlink()
    (path / "config.json").write_text(json.dumps(hf_config(shape), indent=1))
    params = nbytes = 0
    shards: list[dict[str, str]] = []  # per shard: tensor name -> shard's file
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = 0

    def flush() -> None:
        nonlocal pending, pending_bytes
        name = f"part-{len(shards):05d}.safetensors"
        save_file(pending, str(path / name), metadata={"format": "pt"})
        shards.append(dict.fromkeys(pending, name))
        pending, pending_bytes = {}, 0

    for name, tensor in iter_weights(shape, device, seed):
        size = tensor.numel() * tensor.element_size()
        params += tensor.numel() * (2 if name.endswith("_blocks") else 1)
        nbytes += size
        if pending and pending_bytes + size > shard_bytes:
            flush()
        pending[name] = tensor.contiguous().cpu()
        pending_bytes += size
        del tensor
    flush()
    if len(shards) == 1:
        (path / shards[0][next(iter(shards[0]))]).rename(path / "model.safetensors")
    else:
        weight_map: dict[str, str] = {}
        for k, shard in enumerate(shards, 1):
            final = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
            (path / next(iter(shard.values()))).rename(path / final)
            weight_map |= dict.fromkeys(shard, final)
        (path / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": nbytes}, "weight_map": dict(sorted(weight_map.items()))}, indent=1))
    synthetic_tokenizer(shape.vocab).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": SPECIAL_TOKENS[0], "eos_token": SPECIAL_TOKENS[1], "pad_token": SPECIAL_TOKENS[2],
        "add_bos_token": True, "add_eos_token": False, "chat_template": CHAT_TEMPLATE,
        "model_max_length": shape.max_position,
        # not the family's own class (Qwen2Tokenizer adds an <|endoftext|> past the vocabulary): tokenizer.json as is
        "tokenizer_class": "PreTrainedTokenizerFast"}, indent=1))
    return ModelDir(path, params, nbytes, active_weight_bytes(shape))


def shape_by_name(name: str) -> Shape:
    """A SHAPES entry, or "NAME@L": that shape with L layers (e.g. "qwen3-30b-a3b@12")."""
    base, _, layers = name.partition("@")
    if base not in SHAPES:
        raise KeyError(f"unknown shape {base!r}; shapes: {', '.join(SHAPES)}")
    if not layers:
        return SHAPES[base]
    if not layers.isdigit() or int(layers) < 1:
        raise KeyError(f"{name!r}: the layer count after @ must be a positive integer")
    return replace(SHAPES[base], layers=int(layers))


def main(argv: list[str] | None = None) -> None:
    """`python bench/synthetic_model.py SHAPE DIR`: write one shape's directory (e.g. for bench/engine_speed.py)."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("shape", help=f"one of {', '.join(SHAPES)}, or NAME@LAYERS")
    ap.add_argument("path", type=Path)
    ap.add_argument("--device", default="cpu", help="where the weights are drawn (cuda: faster)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    shape = shape_by_name(args.shape)
    info = write_model_dir(shape, args.path, args.device, args.seed)
    print(json.dumps({"path": str(info.path), "params": info.params, "weight_bytes": info.weight_bytes,
                      "active_bytes_batch1": round(info.active_bytes)}))


if __name__ == "__main__":
    main()
