"""Random tiny models of every supported family, written both as a Hugging Face safetensors directory
and as a GGUF file in llama.cpp's layout, with the same weights.

    tiny = build_tiny_model("qwen3", tmp_path)          # hf_model, safetensors_dir, gguf_path (F32), config
    q8 = write_gguf(tiny, "Q8_0")                        # another GGUF copy, 2-D matrices in Q8_0
    ref = reference_model(tiny, "Q8_0")                  # HF model holding exactly the dequantized weights

The GGUF is what llama.cpp's `convert_hf_to_gguf.py` would produce for the same checkpoint:

* tensor names `token_embd`, `blk.N.attn_q`, ... `output_norm`, `output` (only when untied);
* `attn_q`/`attn_k` rows of the `llama` architecture permuted with llama.cpp's `permute` (llama.cpp
  rotates interleaved pairs, HF rotates halves); qwen2, qwen3 and gemma3 are stored unpermuted;
* every `*norm.weight` of gemma3 stored as `1 + w` (HF Gemma norms multiply by `1 + w`);
* Llama 3 rope scaling as a `rope_freqs.weight` F32 tensor of per-frequency divisors;
* 1-D tensors (norms, biases, rope_freqs) always F32; 2-D matrices F32 or the requested type;
* a byte-level BPE tokenizer (`tokenizer.ggml.model = "gpt2"`), the same one as `tokenizer.json`.

Mixtures of experts, as llama.cpp's converter writes them (architectures `qwen3moe`, `qwen2moe`, `olmoe`,
`gpt-oss`, and `llama` for Mixtral, q/k permuted as llama's):

* the routed experts stacked per projection, `blk.N.ffn_{gate,up,down}_exps.weight` [E, out, in] (GGUF
  ne = [in, out, E]), in the requested type like the 2-D matrices (MXFP4: only they); gpt-oss's expert biases
  `blk.N.ffn_{gate,up,down}_exps.bias` [E, out], its interleaved gate/up split and its transposed stacks turned;
* the router `blk.N.ffn_gate_inp` (gpt-oss: with `.bias`) and Qwen2-MoE's shared-expert gate
  `blk.N.ffn_gate_inp_shexp` [1, H] always F32; its shared expert `blk.N.ffn_{gate,up,down}_shexp`;
* gpt-oss's `blk.N.attn_sinks.weight` and its pre-MLP norm `blk.N.post_attention_norm`;
* `{arch}.expert_count`, `expert_used_count`, `expert_feed_forward_length` (Qwen-MoE, gpt-oss),
  `expert_shared_feed_forward_length` (Qwen2-MoE), gpt-oss's `attention.sliding_window` and `rope.scaling.*`
  (yarn). Nothing carries the routers' renormalisation: llama.cpp hard-codes it per architecture.

tests/engine/test_tiny_models.py checks all this against transformers' own GGUF loader (where it reads the
architecture) and gguf-py's reader.
"""

from __future__ import annotations

import copy
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType, LlamaFileType
from gguf.quants import dequantize, quantize
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VARIANTS = ["llama_tied", "llama3_scaled", "qwen2", "qwen3", "gemma3"]
# Mixture-of-experts families (each with its own config.json model_type).
MOE_VARIANTS = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "gpt_oss"]

# GGUF storage types for the 2-D matrices (and 3-D expert stacks); F32 is the exact copy.
GGUF_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0"]
# Only for mixtures of experts: MXFP4 experts (gpt-oss's own format), every other tensor F32.
MOE_GGUF_TYPES = ["MXFP4"]

_QTYPE = {name: GGMLQuantizationType[name] for name in GGUF_TYPES + MOE_GGUF_TYPES}
_FILE_TYPE = {
    "F32": LlamaFileType.ALL_F32,
    "F16": LlamaFileType.MOSTLY_F16,
    "BF16": LlamaFileType.MOSTLY_BF16,
    "Q8_0": LlamaFileType.MOSTLY_Q8_0,
    "Q4_0": LlamaFileType.MOSTLY_Q4_0,
    "Q4_1": LlamaFileType.MOSTLY_Q4_1,
    "Q5_0": LlamaFileType.MOSTLY_Q5_0,
    "MXFP4": LlamaFileType.MOSTLY_MXFP4_MOE,
}

VOCAB_SIZE = 320

_CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


@dataclass(frozen=True)
class _TokenizerSpec:
    special: tuple[str, ...]  # ids 0..len-1, in this order
    bos: str
    eos: str
    pad: str | None
    add_bos: bool
    chat_template: str
    # generation_config.json's eos_token_id, when the model lists several end tokens (empty: the eos alone)
    end_tokens: tuple[str, ...] = ()


_CHATML_SPEC = _TokenizerSpec(
    special=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    bos="<|im_start|>",
    eos="<|im_end|>",
    pad="<|endoftext|>",
    add_bos=False,
    chat_template=_CHATML_TEMPLATE,
)
_LLAMA3_SPEC = _TokenizerSpec(
    special=("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|im_start|>", "<|im_end|>"),
    bos="<|begin_of_text|>",
    eos="<|eot_id|>",
    pad=None,
    add_bos=True,
    chat_template=_CHATML_TEMPLATE,
)
# Qwen3's chat template, reduced to what thinking needs: earlier answers' thinking is dropped, the answers after the
# last user turn keep theirs (`reasoning_content`), and `enable_thinking=false` writes an empty thinking block.
_QWEN3_THINKING_TEMPLATE = (
    "{%- set ns = namespace(last_query=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}{%- set index = messages|length - 1 - loop.index0 %}"
    "{%- if message.role == 'user' and ns.last_query == messages|length - 1 %}{%- set ns.last_query = index %}"
    "{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{%- set content = message.content %}{%- set thinking = '' %}"
    "{%- if message.reasoning_content is defined and message.reasoning_content is string %}"
    "{%- set thinking = message.reasoning_content %}"
    "{%- elif '</think>' in content %}"
    "{%- set thinking = content.split('</think>')[0].split('<think>')[-1].strip() %}"
    "{%- set content = content.split('</think>')[-1].lstrip() %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query and thinking %}"
    "{{- '<|im_start|>assistant\n<think>\n' + thinking.strip() + '\n</think>\n\n' + content + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>assistant\n' + content + '<|im_end|>\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}"
    "{%- endif %}"
)
_QWEN3_THINKING_SPEC = _TokenizerSpec(
    special=("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"),
    bos="<|im_start|>",
    eos="<|im_end|>",
    pad="<|endoftext|>",
    add_bos=False,
    chat_template=_QWEN3_THINKING_TEMPLATE,
)
# gpt-oss's harmony format: its special tokens (in the order of their ids in o200k_harmony), its end tokens as its
# generation_config.json lists them (<|return|>, <|endoftext|>, <|call|>; <|end|> ends each message, not the
# output) and openai/gpt-oss-20b's own chat template (tests/data/gpt_oss_chat_template.jinja: the copy llama.cpp
# ships as models/templates/openai-gpt-oss-120b.jinja, taken from llama-cpp-python's sdist).
GPT_OSS_TEMPLATE_PATH = Path(__file__).resolve().parents[1] / "data" / "gpt_oss_chat_template.jinja"
_HARMONY_SPEC = _TokenizerSpec(
    special=("<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>",
             "<|end|>", "<|message|>", "<|call|>"),
    bos="<|startoftext|>",
    eos="<|return|>",
    pad="<|endoftext|>",
    add_bos=False,
    chat_template=GPT_OSS_TEMPLATE_PATH.read_text(encoding="utf-8"),
    end_tokens=("<|return|>", "<|endoftext|>", "<|call|>"),
)
_GEMMA_SPEC = _TokenizerSpec(
    special=("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"),
    bos="<bos>",
    eos="<eos>",
    pad="<pad>",
    add_bos=True,
    chat_template=_GEMMA_TEMPLATE,
)


@dataclass
class TinyModel:
    variant: str
    family: str  # the engine's family: llama | qwen2 | qwen3 | gemma3 | MoE_VARIANTS' (gguf_arch: the GGUF one)
    hf_model: torch.nn.Module  # float32, eval mode; the weights of safetensors_dir and the F32 GGUF
    config: object  # the transformers config
    safetensors_dir: Path
    gguf_path: Path  # the copy written with gguf_type
    gguf_type: str
    bos_token_id: int
    eos_token_id: int
    add_bos: bool


# --------------------------------------------------------------------------------------------------
# configs and random weights


def _make_config(variant: str, spec: _TokenizerSpec):
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config, Qwen3Config

    ids = {tok: i for i, tok in enumerate(spec.special)}
    common = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        max_position_embeddings=512,
        bos_token_id=ids[spec.bos],
        eos_token_id=ids[spec.eos],
        pad_token_id=ids[spec.pad] if spec.pad else None,
        dtype="float32",
    )
    if variant == "llama_tied":  # SmolLM2-like
        return LlamaConfig(
            **common,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            tie_word_embeddings=True,
        )
    if variant == "llama3_scaled":  # Llama 3.2-like
        return LlamaConfig(
            **common,
            intermediate_size=96,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=1,
            rms_norm_eps=1e-5,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                # small, so that wavelengths fall in all three of llama3's bands at head_dim 16
                "original_max_position_embeddings": 64,
            },
            tie_word_embeddings=False,
        )
    if variant == "qwen2":  # Qwen2.5-0.5B-like: q/k/v biases, tied
        return Qwen2Config(
            **common,
            intermediate_size=160,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            tie_word_embeddings=True,
            use_sliding_window=False,
        )
    if variant in ("qwen3_thinking", "gpt_oss_harmony"):  # room for a thinking budget, tools' prompts and an answer
        common["max_position_embeddings"] = 2048
    if variant == "gpt_oss_harmony":  # gpt_oss's layers with gpt-oss's tokens and template
        return _moe_config("gpt_oss", common)
    if variant in ("qwen3", "qwen3_thinking"):  # q/k RMSNorm, head_dim 32 != 64 / 4, untied
        return Qwen3Config(
            **common,
            intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            tie_word_embeddings=False,
            use_sliding_window=False,
        )
    if variant == "gemma3":
        return Gemma3TextConfig(
            **common,
            intermediate_size=128,
            num_hidden_layers=7,  # layer 5 global, the rest sliding
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=32,
            query_pre_attn_scalar=32,  # = head_dim, as llama.cpp assumes
            sliding_window=8,
            rms_norm_eps=1e-6,
            hidden_activation="gelu_pytorch_tanh",
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
            tie_word_embeddings=True,
            final_logit_softcapping=None,
            attn_logit_softcapping=None,
        )
    if variant in MOE_VARIANTS:
        return _moe_config(variant, common)
    raise ValueError(f"unknown tiny model variant {variant!r}; known: {VARIANTS + MOE_VARIANTS}")


def _moe_config(variant: str, common: dict):
    """Tiny mixture-of-experts configs: enough experts that routing varies per token, top 2 of them."""
    from transformers import GptOssConfig, MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig

    attention = dict(num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, tie_word_embeddings=False)
    if variant == "qwen3_moe":  # per-head q/k norms, renormalised top-k, one dense layer (mlp_only_layers);
        # FFN widths 128 and 64: split over 2 ranks, each rank's share of a 4-bit row is whole blocks of 32
        return Qwen3MoeConfig(**common, **attention, head_dim=32, num_hidden_layers=3, intermediate_size=128,
                              moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                              mlp_only_layers=[1], decoder_sparse_step=1,
                              rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                              use_sliding_window=False)
    if variant == "qwen2_moe":  # q/k/v biases, a gated shared expert, top-k not renormalised
        return Qwen2MoeConfig(**common, **attention, num_hidden_layers=2, intermediate_size=96,
                              moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=6,
                              num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1,
                              rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                              use_sliding_window=False)
    if variant == "mixtral":
        return MixtralConfig(**{**common, **attention, "num_key_value_heads": 1}, num_hidden_layers=2,
                             intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
                             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if variant == "olmoe":  # q/k norms over all heads' features at once
        return OlmoeConfig(**common, **attention, num_hidden_layers=2, intermediate_size=32, num_experts=8,
                           num_experts_per_tok=2, norm_topk_prob=False, clip_qkv=None,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    # gpt_oss: attention sinks, q/k/v/o biases, sliding (window 8) and full layers alternating, yarn rope,
    # top-k-then-softmax routing with a router bias, clamped SwiGLU experts with biases
    return GptOssConfig(**common, **attention, head_dim=16, num_hidden_layers=4, intermediate_size=32,
                        num_local_experts=4, num_experts_per_tok=2, sliding_window=8, attention_bias=True,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                         "original_max_position_embeddings": 64})


_FAMILY = {"llama_tied": "llama", "llama3_scaled": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3",
           "qwen3_thinking": "qwen3", "gpt_oss_harmony": "gpt_oss", **{v: v for v in MOE_VARIANTS}}
# The architecture llama.cpp's converter writes (Mixtral as "llama" with experts).
_GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3", "qwen3_moe": "qwen3moe",
              "qwen2_moe": "qwen2moe", "mixtral": "llama", "olmoe": "olmoe", "gpt_oss": "gpt-oss"}
_SPEC = {
    "llama_tied": _CHATML_SPEC,
    "llama3_scaled": _LLAMA3_SPEC,
    "qwen2": _CHATML_SPEC,
    "qwen3": _CHATML_SPEC,
    "gemma3": _GEMMA_SPEC,
    # A reasoning model (not in VARIANTS: its layers are qwen3's): <think> and </think> are tokens of the vocabulary.
    "qwen3_thinking": _QWEN3_THINKING_SPEC,
    **{variant: _CHATML_SPEC for variant in MOE_VARIANTS},
    # gpt-oss's tokens and chat template (harmony), for the server's harmony tests (not in VARIANTS)
    "gpt_oss_harmony": _HARMONY_SPEC,
}
# picked so that 16 greedy steps after PROMPTS[0] vary and no two top logits are within 2e-3
_SEED = {"llama_tied": 107, "llama3_scaled": 307, "qwen2": 407, "qwen3": 507, "gemma3": 15, "qwen3_thinking": 507,
         "qwen3_moe": 607, "qwen2_moe": 707, "mixtral": 807, "olmoe": 907, "gpt_oss": 1007, "gpt_oss_harmony": 507}


@torch.no_grad()
def _randomize(model, family: str, seed: int) -> None:
    """Weights with enough spread that logits differ by whole units: HF's own init (std 0.02,
    zero biases, unit or zero norms) would leave biases, norms and the (1 + w) convention untested."""
    gen = torch.Generator().manual_seed(seed)

    def randn(shape):
        return torch.randn(shape, generator=gen, dtype=torch.float32)

    for name, param in model.named_parameters():  # tied lm_head shares embed_tokens' parameter
        if name.endswith("norm.weight"):
            # gemma multiplies by (1 + w); the others by w
            param.copy_(0.2 * randn(param.shape) + (0.0 if family == "gemma3" else 1.0))
        elif name.endswith((".bias", "_bias")):
            param.copy_(0.5 * randn(param.shape))
        elif name.endswith("self_attn.sinks"):  # gpt-oss: a logit per head beside the keys' scores
            param.copy_(randn(param.shape))
        elif param.dim() == 3:  # stacked experts: [E, out, in], or gpt-oss's transposed [E, in, out]
            fan_in = param.shape[1] if family == "gpt_oss" else param.shape[2]
            gain = 2.0 if "down_proj" in name else 1.0
            param.copy_(gain * randn(param.shape) / math.sqrt(fan_in))
        elif name == "model.embed_tokens.weight":
            # small, so the residual stream is not dominated by the current token's embedding (with
            # tied embeddings that makes greedy decoding repeat one token forever)
            param.copy_(0.1 * randn(param.shape))
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            param.copy_(2.0 * randn(param.shape) / math.sqrt(param.shape[1]))
        elif param.dim() == 2:
            param.copy_(randn(param.shape) / math.sqrt(param.shape[1]))
        else:
            raise AssertionError(f"unexpected parameter {name} {tuple(param.shape)}")


# --------------------------------------------------------------------------------------------------
# tokenizer

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A tiny model is small, but the tokenizer is real.",
    "Hello world! Hello there, how are you today?",
    "Numbers like 12, 345 and 6789 are split into pieces.",
    "The engine reads safetensors and GGUF files, then it generates text.",
    "She sells sea shells by the sea shore; the shells she sells are surely sea shells.",
    "Peter Piper picked a peck of pickled peppers.",
    "In the beginning there was the token, and the token was with the merges.",
    "def main():\n    print('hello, world')\n    return 0\n",
    "Attention is all you need: queries, keys and values.",
    "Rotary position embeddings rotate pairs of dimensions by an angle.",
    "The sliding window lets each token see only the tokens just before it.",
]


def _train_tokenizer(spec: _TokenizerSpec, vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(spec.special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 3, trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise AssertionError(f"trained {tok.get_vocab_size()} tokens, wanted {vocab_size}: grow the corpus")
    for i, special in enumerate(spec.special):
        assert tok.token_to_id(special) == i
    return tok


def _save_hf_tokenizer(tok: Tokenizer, spec: _TokenizerSpec, out_dir: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=spec.bos,
        eos_token=spec.eos,
        pad_token=spec.pad,
        add_bos_token=spec.add_bos,
        add_eos_token=False,
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )
    hf_tok.chat_template = spec.chat_template
    hf_tok.save_pretrained(str(out_dir))
    # transformers 5 keeps these in tokenizer.json's post-processor and chat_template.jinja; most
    # published repos also state them in tokenizer_config.json, so do the same
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg.update(add_bos_token=spec.add_bos, add_eos_token=False, chat_template=spec.chat_template)
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _gguf_vocab(tokenizer_json: Path) -> tuple[list[str], list[int], list[str]]:
    """(tokens by id, token types, merges "a b") from the saved tokenizer.json."""
    data = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    vocab = data["model"]["vocab"]
    tokens = [None] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    types = [int(gguf.TokenType.NORMAL)] * len(tokens)
    for added in data["added_tokens"]:
        tokens[added["id"]] = added["content"]
        types[added["id"]] = int(gguf.TokenType.CONTROL if added["special"] else gguf.TokenType.USER_DEFINED)
    assert all(t is not None for t in tokens)
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return tokens, types, merges


# --------------------------------------------------------------------------------------------------
# GGUF writer


def llama_permute(weights: torch.Tensor, n_head: int, n_head_kv: int | None) -> torch.Tensor:
    """llama.cpp's `LlamaModel.permute` (convert_hf_to_gguf.py), applied to attn_q / attn_k rows."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def llama3_rope_factors(config) -> torch.Tensor:
    """llama.cpp's `rope_freqs` for rope_type llama3 (LlamaModel.generate_extra_tensors)."""
    rope = config.rope_parameters
    base = rope["rope_theta"]
    dim = _head_dim(config)
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = rope.get("factor", 8.0)
    low_freq_factor = rope.get("low_freq_factor", 1.0)
    high_freq_factor = rope.get("high_freq_factor", 4.0)
    old_context_len = rope.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def gguf_arch(tiny: "TinyModel") -> str:
    """The `general.architecture` llama.cpp's converter writes for this variant."""
    return _GGUF_ARCH[tiny.family]


def _gguf_tensor_name(hf_name: str, family: str) -> str:
    """The GGUF name of a 1:1 HF tensor (not the routed experts, which split and stack: `_gguf_tensors`)."""
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    parts = hf_name.split(".")
    assert parts[:2] == ["model", "layers"], hf_name
    bid, leaf, suffix = parts[2], ".".join(parts[3:-1]), parts[-1]
    if hf_name.endswith("self_attn.sinks"):  # gpt-oss: llama.cpp names it with a `.weight`
        leaf, suffix = "self_attn.sinks", "weight"
    names = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "self_attn.sinks": "attn_sinks",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        # mixtures of experts: the router (gpt-oss's has a bias), Qwen2-MoE's shared expert and its gate
        "mlp.gate": "ffn_gate_inp",
        "mlp.router": "ffn_gate_inp",
        "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
        "mlp.shared_expert.up_proj": "ffn_up_shexp",
        "mlp.shared_expert.down_proj": "ffn_down_shexp",
        "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    }
    if family == "gemma3":
        names |= {
            "post_attention_layernorm": "post_attention_norm",
            "pre_feedforward_layernorm": "ffn_norm",
            "post_feedforward_layernorm": "post_ffw_norm",
        }
    elif family == "gpt_oss":  # llama.cpp's ATTN_POST_NORM: gpt-oss's norm before the MLP
        names["post_attention_layernorm"] = "post_attention_norm"
    else:
        names["post_attention_layernorm"] = "ffn_norm"
    return f"blk.{bid}.{names[leaf]}.{suffix}"


_HF_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?")


def _expert_tensors(hf_name: str, data: torch.Tensor, family: str) -> list[tuple[str, torch.Tensor]] | None:
    """The routed experts of one HF parameter as llama.cpp writes them: one 3-D stack per projection,
    `blk.N.ffn_{gate,up,down}_exps.weight` [E, out, in] (GGUF ne = [in, out, E]), gpt-oss's biases
    `blk.N.ffn_{gate,up,down}_exps.bias` [E, out]; None for any other parameter.

    transformers 5 holds experts fused: `gate_up_proj` [E, 2I, H] (gate rows, then up rows) and `down_proj`
    [E, H, I]; gpt-oss transposed with gate and up interleaved, `gate_up_proj` [E, H, 2I] (gate in the even
    columns), `down_proj` [E, I, H], biases [E, 2I] (interleaved) and [E, H] (GptOssModel.modify_tensors)."""
    m = _HF_EXPERTS.fullmatch(hf_name)
    if m is None:
        return None
    bid, kind, bias = m[1], m[2], bool(m[3])
    suffix = "bias" if bias else "weight"
    if family == "gpt_oss" and not bias:
        data = data.transpose(1, 2)  # [E, out, in]
    if kind == "down_proj":
        return [(f"blk.{bid}.ffn_down_exps.{suffix}", data.contiguous())]
    if family == "gpt_oss":
        gate, up = data[:, 0::2], data[:, 1::2]
    else:
        gate, up = data.chunk(2, dim=1)
    return [(f"blk.{bid}.ffn_gate_exps.{suffix}", gate.contiguous()), (f"blk.{bid}.ffn_up_exps.{suffix}", up.contiguous())]


def _gguf_tensors(hf_name: str, data: torch.Tensor, family: str) -> list[tuple[str, torch.Tensor]]:
    """[(GGUF name, float32 tensor)] for one HF parameter."""
    experts = _expert_tensors(hf_name, data, family)
    return experts if experts is not None else [(_gguf_tensor_name(hf_name, family), data)]


# llama.cpp's converter keeps these in F32 whatever the requested type (ModelBase.prepare_tensors): routers
_F32_MATRICES = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")


def _storage_type(name: str, shape: tuple[int, ...], gguf_type: str) -> str:
    """The type a tensor of `shape` (GGUF's orientation: rows along the last dim) is stored in: 1-D tensors,
    norms, biases and routers always F32 (as llama.cpp); with MXFP4 only the experts' matrices (llama.cpp converts
    gpt-oss's MXFP4 checkpoint so), else every matrix; F16 where rows are not whole blocks of the type (the
    converter's fallback on gguf-py's QuantError)."""
    if len(shape) < 2 or name.endswith("_norm.weight") or not name.endswith(".weight") or name.endswith(_F32_MATRICES):
        return "F32"
    if gguf_type == "MXFP4" and not name.endswith("_exps.weight"):
        return "F32"
    if shape[-1] % gguf.GGML_QUANT_SIZES[_QTYPE[gguf_type]][0]:
        return "F16"
    return gguf_type


def _roundtrip(array: np.ndarray, gguf_type: str) -> np.ndarray:
    qtype = _QTYPE[gguf_type]
    return dequantize(quantize(array, qtype), qtype).astype(np.float32).reshape(array.shape)


def _llama_cpp_tensors(hf_model, family: str, *, _permute: bool = True, _gemma_norm_offset: bool = True):
    """[(gguf name, float32 array)] in the order llama.cpp writes them."""
    config = hf_model.config
    arch = _GGUF_ARCH[family]
    out = []
    state = hf_model.state_dict()
    for hf_name, tensor in state.items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        for name, data in _gguf_tensors(hf_name, tensor.detach().to(torch.float32).clone(), family):
            if arch == "llama" and _permute:  # llama and Mixtral
                if name.endswith(".attn_q.weight") or name.endswith(".attn_q.bias"):
                    data = llama_permute(data, config.num_attention_heads, config.num_attention_heads)
                elif name.endswith(".attn_k.weight") or name.endswith(".attn_k.bias"):
                    data = llama_permute(data, config.num_attention_heads, config.num_key_value_heads)
            if family == "gemma3" and name.endswith("norm.weight") and _gemma_norm_offset:
                data = data + 1
            out.append((name, data.numpy()))
    rope = getattr(config, "rope_parameters", None) or {}
    if family == "llama" and rope.get("rope_type") == "llama3":
        out.insert(0, ("rope_freqs.weight", llama3_rope_factors(config).numpy()))
    # order as llama.cpp: token_embd, rope_freqs?, blocks..., output_norm, output
    order = {"token_embd.weight": 0, "rope_freqs.weight": 1, "output_norm.weight": 3, "output.weight": 4}
    out.sort(key=lambda item: (order.get(item[0], 2), _block_index(item[0])))
    return out


def _block_index(name: str) -> int:
    return int(name.split(".")[1]) if name.startswith("blk.") else -1


def _dense_layers(config) -> list[int]:
    """Qwen-MoE's layers with a dense MLP (mlp_only_layers, decoder_sparse_step)."""
    if not getattr(config, "num_experts", None) or not hasattr(config, "mlp_only_layers"):
        return []
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return [i for i in range(config.num_hidden_layers)
            if i in (config.mlp_only_layers or []) or (i + 1) % step]


def _check_names_known(names: list[str], arch: str, n_layers: int, dense_layers: list[int] = ()) -> None:
    """Every tensor name is one gguf-py lists for this architecture.

    Except the dense MLP (`ffn_gate`/`ffn_up`/`ffn_down`) of a Qwen-MoE's dense layers: gguf-py's qwen3moe and
    qwen2moe layouts have none (llama.cpp's converter cannot convert such a checkpoint, and its loader wants a
    router in every layer); they take the names every other architecture gives a dense MLP."""
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    known = set()
    for tensor in gguf.MODEL_TENSORS[arch_id]:
        pattern = gguf.TENSOR_NAMES[tensor]
        for bid in range(n_layers) if "{bid}" in pattern else [None]:
            known.add(pattern.format(bid=bid))
    for bid in dense_layers:
        known |= {gguf.TENSOR_NAMES[t].format(bid=bid) for t in
                  (gguf.MODEL_TENSOR.FFN_GATE, gguf.MODEL_TENSOR.FFN_UP, gguf.MODEL_TENSOR.FFN_DOWN)}
    unknown = [n for n in names if n.rsplit(".", 1)[0] not in known]
    if unknown:
        raise AssertionError(f"tensor names not in gguf-py's {arch} layout: {unknown}")


def _add_moe_metadata(writer: gguf.GGUFWriter, config, family: str) -> None:
    """The mixture-of-experts keys llama.cpp's converter writes (TextModel and each family's
    set_gguf_parameters): expert counts, the expert (and shared expert) widths, gpt-oss's window and yarn."""
    writer.add_expert_count(getattr(config, "num_experts", None) or config.num_local_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if family in ("qwen3_moe", "qwen2_moe"):
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if family == "qwen2_moe":
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if family == "gpt_oss":
        writer.add_sliding_window(config.sliding_window)
        writer.add_expert_feed_forward_length(config.intermediate_size)
        rope = config.rope_parameters
        if rope.get("rope_type") == "yarn":
            writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            writer.add_rope_scaling_factor(rope["factor"])
            writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
            if rope.get("attention_factor") is not None:
                writer.add_rope_scaling_yarn_attn_factor(rope["attention_factor"])
            writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
            writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])


def _add_tensor(writer: gguf.GGUFWriter, name: str, array: np.ndarray, storage: str) -> None:
    if storage == "F32":
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
        return
    qtype = _QTYPE[storage]
    data = quantize(np.ascontiguousarray(array, dtype=np.float32), qtype)
    if storage == "F16":
        writer.add_tensor(name, data)  # float16 array: the writer infers F16 and the shape
    else:
        # uint8 blocks: with raw_dtype the writer turns the byte shape back into the element shape
        writer.add_tensor(name, data, raw_dtype=qtype)


def write_gguf(tiny: TinyModel, gguf_type: str = "F32", path: Path | None = None, *, split_max_tensors: int = 0,
               **_layout) -> Path:
    """Write `tiny.hf_model` as a llama.cpp-layout GGUF with 2-D matrices (and 3-D expert stacks) stored as
    `gguf_type` (MXFP4: only the experts, for mixtures of experts). With `split_max_tensors`, split it the way
    llama.cpp's gguf-split does (gguf-py's writer: files `<stem>-00001-of-0000N.gguf` of at most that many tensors,
    the metadata in the first, `split.*` keys in each) and return the first file."""
    if gguf_type not in _QTYPE:
        raise ValueError(f"gguf_type {gguf_type!r} not in {GGUF_TYPES + MOE_GGUF_TYPES}")
    path = Path(path) if path is not None else tiny.safetensors_dir.parent / f"{tiny.variant}-{gguf_type}.gguf"
    config = tiny.hf_model.config
    family = tiny.family
    arch = _GGUF_ARCH[family]
    tensors = _llama_cpp_tensors(tiny.hf_model, family, **_layout)
    _check_names_known([name for name, _ in tensors], arch, config.num_hidden_layers, _dense_layers(config))

    writer = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)  # writes general.architecture
    writer.add_name(f"tiny-{tiny.variant}")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = _head_dim(config)
    if family == "gemma3" or head_dim != config.hidden_size // config.num_attention_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    rope = config.rope_parameters
    if family == "gemma3":
        # global layers' base; llama.cpp hard-codes 10000 for the sliding ones
        writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        writer.add_sliding_window(config.sliding_window)
    else:
        writer.add_rope_freq_base(rope["rope_theta"])
    # (llama.cpp's OLMoE converter writes 1e-5 whatever the config says, right for OLMoE-1B-7B; the tiny
    # model's own epsilon keeps the file true to its weights)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(head_dim)
    if arch == "llama":
        writer.add_vocab_size(config.vocab_size)
    if family in MOE_VARIANTS:
        _add_moe_metadata(writer, config, family)
    writer.add_file_type(_FILE_TYPE[gguf_type])
    if gguf_type not in ("F32", "F16", "BF16"):
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

    spec = _SPEC[tiny.variant]
    tokens, types, merges = _gguf_vocab(tiny.safetensors_dir / "tokenizer.json")
    assert len(tokens) == config.vocab_size
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index(spec.bos))
    writer.add_eos_token_id(tokens.index(spec.eos))
    if spec.pad is not None:
        writer.add_pad_token_id(tokens.index(spec.pad))
    writer.add_add_bos_token(spec.add_bos)
    writer.add_add_eos_token(False)
    writer.add_chat_template(spec.chat_template)

    for name, array in tensors:
        _add_tensor(writer, name, array, _storage_type(name, array.shape, gguf_type))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return writer.format_shard_names(path)[0]


def reference_model(tiny: TinyModel, gguf_type: str):
    """The HF model whose weights are exactly what a `gguf_type` copy holds after dequantization."""
    if gguf_type == "F32":
        return tiny.hf_model
    ref = copy.deepcopy(tiny.hf_model)
    family = tiny.family
    with torch.no_grad():
        for hf_name, param in ref.named_parameters():
            # GGUF rows run along the input dim: the last one, but the middle one of gpt-oss's [E, in, out]
            # experts; the converter's other changes (splits, interleaving, the llama permutation) move whole rows
            transposed = family == "gpt_oss" and param.dim() == 3
            array = (param.detach().transpose(1, 2) if transposed else param.detach()).contiguous().numpy()
            storage = _storage_type(_gguf_tensors(hf_name, param.detach(), family)[0][0], array.shape, gguf_type)
            if storage == "F32":
                continue
            stored = torch.from_numpy(_roundtrip(array, storage))
            param.copy_(stored.transpose(1, 2) if transposed else stored)
    return ref.eval()


# --------------------------------------------------------------------------------------------------


def build_tiny_model(variant: str, out_dir: Path, gguf_type: str = "F32") -> TinyModel:
    """Build `variant` with its fixed seed; save it under `out_dir/variant/` as a safetensors
    directory (`hf/`) and a GGUF file (`variant-<gguf_type>.gguf`)."""
    from transformers import AutoModelForCausalLM

    spec = _SPEC[variant]
    family = _FAMILY[variant]
    root = Path(out_dir) / variant
    hf_dir = root / "hf"
    hf_dir.mkdir(parents=True, exist_ok=True)

    config = _make_config(variant, spec)
    config._attn_implementation = "eager"
    torch.manual_seed(_SEED[variant])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, family, _SEED[variant])
    model.eval()
    if model.generation_config is not None:
        model.generation_config.bos_token_id = config.bos_token_id
        model.generation_config.eos_token_id = config.eos_token_id
        if spec.end_tokens:
            model.generation_config.eos_token_id = [spec.special.index(t) for t in spec.end_tokens]
        model.generation_config.pad_token_id = config.pad_token_id
    model.save_pretrained(str(hf_dir))

    tok = _train_tokenizer(spec, config.vocab_size)
    _save_hf_tokenizer(tok, spec, hf_dir)

    tiny = TinyModel(
        variant=variant,
        family=family,
        hf_model=model,
        config=config,
        safetensors_dir=hf_dir,
        gguf_path=None,  # set below
        gguf_type=gguf_type,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        add_bos=spec.add_bos,
    )
    tiny.gguf_path = write_gguf(tiny, gguf_type)
    return tiny


# --------------------------------------------------------------------------------------------------
# reference helpers shared by the tests

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. Peter Piper picked a peck of pickled peppers; she sells sea shells.",
    "Hello world! Numbers like 12, 345 and 6789 are split into pieces, then the engine generates text.",
]


def prompt_ids(tiny: TinyModel, which: int = 0, length: int = 24) -> list[int]:
    """The first `length` ids of PROMPTS[which] under the model's tokenizer (BOS included when it adds one)."""
    tok = Tokenizer.from_file(str(tiny.safetensors_dir / "tokenizer.json"))
    ids = tok.encode(PROMPTS[which]).ids
    if len(ids) < length:
        raise AssertionError(f"prompt {which} has only {len(ids)} tokens")
    return ids[:length]


@torch.no_grad()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] float32 logits of a plain full-sequence forward."""
    return model(input_ids=torch.tensor([ids], dtype=torch.long)).logits[0].float()


@torch.no_grad()
def hf_greedy(model, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """Greedy continuation by full recomputation each step (no KV cache, no EOS stop).

    Returns (the n new ids, logits [len(ids) + n, vocab] of the whole sequence)."""
    seq = list(ids)
    for _ in range(n):
        seq.append(int(hf_logits(model, seq)[-1].argmax()))
    return seq[len(ids) :], hf_logits(model, seq)


# fp32 tolerance, relative to the size of the logits: see test_parity.py for why this value
LOGIT_RTOL = 1e-4


def logit_tolerance(expected: torch.Tensor) -> float:
    return LOGIT_RTOL * max(1.0, float(expected.abs().max()))


def assert_logits_close(actual, expected: torch.Tensor, what: str = "logits") -> None:
    assert isinstance(actual, torch.Tensor), f"{what}: expected a torch.Tensor, got {type(actual).__name__}"
    assert actual.dtype == torch.float32, f"{what}: dtype {actual.dtype}, expected torch.float32"
    assert tuple(actual.shape) == tuple(expected.shape), f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    actual = actual.detach().cpu()
    diff = (actual - expected).abs()
    atol = logit_tolerance(expected)
    if not bool(torch.isfinite(actual).all()) or float(diff.max()) > atol:
        worst = int(diff.argmax())
        if expected.dim() == 2:
            per_pos = diff.amax(dim=-1)
            bad = (per_pos > atol) | ~torch.isfinite(actual).all(dim=-1)
            where = (
                f"worst at (pos, token) {divmod(worst, expected.shape[-1])}; first bad position "
                f"{int(bad.nonzero()[0])} of {expected.shape[0]}"
            )
        else:
            where = f"worst at token {worst}; argmax {int(actual.argmax())} vs {int(expected.argmax())}"
        raise AssertionError(
            f"{what}: max abs diff {float(diff.max()):.3e} > tol {atol:.1e} "
            f"(logit scale {float(expected.abs().max()):.2f}; {where}; mean abs diff {float(diff.mean()):.3e})"
        )
