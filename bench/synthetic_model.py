"""Random-weight models at real shapes, written as a Hugging Face hub directory that `engine.load_runner` reads.

    shape = SHAPES["llama-1b"]
    info = write_model_dir(shape, Path("/dev/shm/llama-1b"), device="cuda")   # config.json, model.safetensors,
                                                                                 # tokenizer.json, tokenizer_config.json
The GPU machine has neither model files nor a network: the weights are drawn on `device` in bfloat16 and saved
straight from torch (safetensors.torch.save_file); the tokenizer is a byte-level BPE over synthetic words whose
vocabulary is exactly the model's, every id decoding to visible text (" w123"), so streamed tokens are chunks.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|pad|>")  # ids 0, 1, 2
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
MAX_POSITION = 4096


@dataclass(frozen=True)
class Shape:
    """A decoder's dimensions; `family` is the config.json model_type."""

    family: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    rope_theta: float
    sliding_window: int = 0  # gemma3: every 6th layer global, the rest sliding

    @property
    def qk_norm(self) -> bool:
        return self.family in ("qwen3", "gemma3_text")

    @property
    def gemma(self) -> bool:
        return self.family == "gemma3_text"


SHAPES = {
    "llama-1b": Shape("llama", 2048, 16, 32, 8, 64, 8192, 49152, 500000.0),
    "qwen3-0.6b": Shape("qwen3", 1024, 28, 16, 8, 128, 3072, 151936, 1000000.0),
    "gemma3-1b": Shape("gemma3_text", 1152, 26, 4, 1, 256, 6912, 262144, 1000000.0, sliding_window=512),
    "tiny": Shape("llama", 64, 2, 4, 2, 16, 128, 512, 10000.0),
    "tiny-gemma3": Shape("gemma3_text", 64, 7, 4, 1, 32, 128, 512, 1000000.0, sliding_window=16),
}


def layer_is_sliding(shape: Shape) -> list[bool]:
    return [bool(shape.sliding_window) and (i + 1) % 6 != 0 for i in range(shape.layers)]


def estimated_weight_bytes(shape: Shape) -> int:
    """bfloat16 bytes of the matrices (norms aside): the tied embedding once, then every layer's projections."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    per_layer = shape.hidden * (2 * q + 2 * kv) + 3 * shape.hidden * shape.ffn
    return 2 * (shape.vocab * shape.hidden + shape.layers * per_layer)


def hf_config(shape: Shape) -> dict[str, Any]:
    """config.json in the Hugging Face format `engine.config.config_from_hf` reads."""
    cfg: dict[str, Any] = {
        "model_type": shape.family, "hidden_size": shape.hidden, "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim,
        "intermediate_size": shape.ffn, "vocab_size": shape.vocab, "max_position_embeddings": MAX_POSITION,
        "rope_theta": shape.rope_theta, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
    }
    if shape.gemma:
        cfg |= {"architectures": ["Gemma3ForCausalLM"], "hidden_activation": "gelu_pytorch_tanh",
                "sliding_window": shape.sliding_window, "rope_local_base_freq": 10000.0,
                "query_pre_attn_scalar": shape.head_dim, "final_logit_softcapping": None,
                "layer_types": ["sliding_attention" if s else "full_attention" for s in layer_is_sliding(shape)]}
    else:
        cfg |= {"architectures": ["LlamaForCausalLM" if shape.family == "llama" else "Qwen3ForCausalLM"],
                "hidden_act": "silu"}
    return cfg


def random_weights(shape: Shape, device: str | torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-named bfloat16 tensors on `device`: matrices ~ N(0, 1/fan_in) (residual outputs smaller, so 30 layers
    stay finite), norms 1 (gemma stores w of 1 + w: 0), the embedding small; lm_head tied, so absent."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def matrix(rows: int, cols: int, gain: float = 1.0) -> torch.Tensor:
        w = torch.randn((rows, cols), generator=gen, device=device, dtype=torch.bfloat16)
        return w.mul_(gain / math.sqrt(cols))

    def norm(dim: int) -> torch.Tensor:
        return torch.full((dim,), 0.0 if shape.gemma else 1.0, device=device, dtype=torch.bfloat16)

    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    residual = 0.5 / math.sqrt(shape.layers)
    state = {"model.embed_tokens.weight": matrix(shape.vocab, h, math.sqrt(h) * 0.02), "model.norm.weight": norm(h)}
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        state |= {p + "self_attn.q_proj.weight": matrix(q, h), p + "self_attn.k_proj.weight": matrix(kv, h),
                  p + "self_attn.v_proj.weight": matrix(kv, h), p + "self_attn.o_proj.weight": matrix(h, q, residual),
                  p + "mlp.gate_proj.weight": matrix(shape.ffn, h), p + "mlp.up_proj.weight": matrix(shape.ffn, h),
                  p + "mlp.down_proj.weight": matrix(h, shape.ffn, residual),
                  p + "input_layernorm.weight": norm(h), p + "post_attention_layernorm.weight": norm(h)}
        if shape.qk_norm:
            state |= {p + "self_attn.q_norm.weight": norm(shape.head_dim),
                      p + "self_attn.k_norm.weight": norm(shape.head_dim)}
        if shape.gemma:
            state |= {p + "pre_feedforward_layernorm.weight": norm(h), p + "post_feedforward_layernorm.weight": norm(h)}
    return state


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
    params: int
    weight_bytes: int  # what one decode step reads: every tensor once (the tied embedding as the LM head)


def write_model_dir(shape: Shape, path: Path, device: str | torch.device) -> ModelDir:
    """Write config.json, model.safetensors and the tokenizer files of `shape` under `path`."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config(shape), indent=1))
    state = random_weights(shape, device)
    params = sum(t.numel() for t in state.values())
    weight_bytes = sum(t.numel() * t.element_size() for t in state.values())
    save_file({k: v.cpu() for k, v in state.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})
    del state
    synthetic_tokenizer(shape.vocab).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": SPECIAL_TOKENS[0], "eos_token": SPECIAL_TOKENS[1], "pad_token": SPECIAL_TOKENS[2],
        "add_bos_token": True, "add_eos_token": False, "chat_template": CHAT_TEMPLATE,
        "model_max_length": MAX_POSITION}, indent=1))
    return ModelDir(path, params, weight_bytes)
