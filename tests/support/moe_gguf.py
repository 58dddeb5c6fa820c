"""Synthetic mixture-of-experts GGUF files: random but valid ggml blocks of any type, written straight into a
llama.cpp-layout Qwen3-MoE file, for what the HF-derived tiny models cannot cover: K-quants (gguf-py cannot
quantize them; their rows need 256 inputs) and sizes big enough to measure memory.

    write_random_moe_gguf(path, expert_type="Q4_K", hidden=256, expert_ff=256)

Random bytes are valid blocks of every type once their float16 scale fields hold finite values (set here to
small ones); gguf-py's `dequantize` (an implementation independent of ours) says what they mean.
"""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from tokenizers import pre_tokenizers

# Byte offsets of each type's float16 scale fields within a block (the rest are codes and packed sub-scales,
# valid whatever their bits), and MXFP4's E8M0 scale byte.
_F16_FIELDS = {Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q4_K: (0, 2),
               Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
_E8M0_FIELDS = {Q.MXFP4: 0}
# The largest code (times the largest sub-block scale) of each type: its scale fields get `scale` / this, so that
# weights stay within about `scale`.
_CODE_RANGE = {Q.Q8_0: 128, Q.Q4_0: 8, Q.Q4_1: 16, Q.Q5_0: 16, Q.Q5_1: 32, Q.Q4_K: 15 * 63, Q.Q5_K: 31 * 63,
               Q.Q6_K: 32 * 128}


def random_blocks(qtype: Q, shape: tuple[int, ...], rng: np.random.Generator, scale: float = 0.01) -> np.ndarray:
    """uint8 [..., bytes per row] of random `qtype` blocks for weights of `shape` [..., in] (float types:
    random values of that type, as bytes), of magnitude about `scale`."""
    if qtype in (Q.F32, Q.F16, Q.BF16):
        values = (rng.standard_normal(shape) * scale).astype(np.float32)
        if qtype == Q.F32:
            return values.view(np.uint8)
        if qtype == Q.F16:
            return values.astype(np.float16).view(np.uint8)
        return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)  # bfloat16: the top half
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    if shape[-1] % block:
        raise ValueError(f"rows of {shape[-1]} are not whole {qtype.name} blocks of {block}")
    blocks = rng.integers(0, 256, (*shape[:-1], shape[-1] // block, size), dtype=np.uint8)
    for offset in _F16_FIELDS.get(qtype, ()):
        d = (scale / _CODE_RANGE[qtype] * rng.uniform(0.5, 1.5, blocks.shape[:-1])).astype(np.float16)
        blocks[..., offset:offset + 2] = d.view(np.uint8).reshape(*d.shape, 2)
    if qtype in _E8M0_FIELDS:  # 2^(e - 127) near `scale` / 4 (E2M1 values reach 6)
        e = np.round(np.log2(scale / 4)) + 127 + rng.integers(-1, 2, blocks.shape[:-1])
        blocks[..., _E8M0_FIELDS[qtype]] = e.astype(np.uint8)
    elif qtype not in _F16_FIELDS:
        raise ValueError(f"no random blocks for {qtype.name}")
    return blocks.reshape(*shape[:-1], -1)


def byte_vocabulary() -> tuple[list[str], list[int]]:
    """A byte-level BPE vocabulary without merges (tokens, token types): an end-of-text token and the 256 bytes."""
    tokens = ["<|endoftext|>", *sorted(pre_tokenizers.ByteLevel.alphabet())]
    return tokens, [int(gguf.TokenType.CONTROL)] + [int(gguf.TokenType.NORMAL)] * 256


def write_random_moe_gguf(path: Path, *, expert_type: str = "Q4_0", other_type: str = "F32", experts: int = 8,
                          top_k: int = 2, layers: int = 2, hidden: int = 256, expert_ff: int = 256, heads: int = 4,
                          kv_heads: int = 2, head_dim: int = 64, seed: int = 0) -> Path:
    """A Qwen3-MoE GGUF (`qwen3moe`, llama.cpp's names and keys) of random weights: expert stacks
    `ffn_{gate,up,down}_exps` in `expert_type`, attention and the output matrix in `other_type`, routers, norms
    and the embedding F32 (the down stack falls back to F16 where its rows are not whole blocks, as the converter
    does). Returns `path`."""
    rng = np.random.default_rng(seed)
    tokens, types = byte_vocabulary()
    vocab = len(tokens)
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    writer.add_name("random-qwen3moe")
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(expert_ff * top_k)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_expert_count(experts)
    writer.add_expert_used_count(top_k)
    writer.add_expert_feed_forward_length(expert_ff)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([])
    writer.add_eos_token_id(0)

    def add(name: str, shape: tuple[int, ...], type_name: str, scale: float = 0.02) -> None:
        qtype = Q[type_name]
        block = gguf.GGML_QUANT_SIZES[qtype][0]
        if shape[-1] % block:
            qtype = Q.F16
        raw = random_blocks(qtype, shape, rng, scale)
        if qtype in (Q.F32, Q.F16):  # float arrays: the writer infers the type and shape
            writer.add_tensor(name, raw.view(np.float32 if qtype == Q.F32 else np.float16).reshape(shape))
        else:  # uint8 blocks: with raw_dtype the writer turns the byte shape back into the element shape
            writer.add_tensor(name, raw, raw_dtype=qtype)

    def add_f32(name: str, values: np.ndarray) -> None:
        writer.add_tensor(name, np.ascontiguousarray(values, dtype=np.float32))

    add_f32("token_embd.weight", rng.standard_normal((vocab, hidden)) * 0.1)
    for i in range(layers):
        add_f32(f"blk.{i}.attn_norm.weight", 1 + 0.1 * rng.standard_normal(hidden))
        add(f"blk.{i}.attn_q.weight", (heads * head_dim, hidden), other_type)
        add(f"blk.{i}.attn_k.weight", (kv_heads * head_dim, hidden), other_type)
        add(f"blk.{i}.attn_v.weight", (kv_heads * head_dim, hidden), other_type)
        add(f"blk.{i}.attn_output.weight", (hidden, heads * head_dim), other_type)
        add_f32(f"blk.{i}.attn_q_norm.weight", 1 + 0.1 * rng.standard_normal(head_dim))
        add_f32(f"blk.{i}.attn_k_norm.weight", 1 + 0.1 * rng.standard_normal(head_dim))
        add_f32(f"blk.{i}.ffn_norm.weight", 1 + 0.1 * rng.standard_normal(hidden))
        add_f32(f"blk.{i}.ffn_gate_inp.weight", rng.standard_normal((experts, hidden)) / np.sqrt(hidden))
        add(f"blk.{i}.ffn_gate_exps.weight", (experts, expert_ff, hidden), expert_type, 0.05)
        add(f"blk.{i}.ffn_up_exps.weight", (experts, expert_ff, hidden), expert_type, 0.05)
        add(f"blk.{i}.ffn_down_exps.weight", (experts, hidden, expert_ff), expert_type, 0.05)
    add_f32("output_norm.weight", 1 + 0.1 * rng.standard_normal(hidden))
    add("output.weight", (vocab, hidden), other_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
