"""`ModelConfig`: one description of a decoder for every family, from GGUF metadata or a Hugging Face config.json;
`EncoderConfig`: the same for the bidirectional encoders that compute sentence embeddings (BERT)."""
from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, get_args

from engine.errors import UnsupportedModelError

# Weight quantization modes (`load_runner(quant=...)`, the server's --quant).
QuantMode = Literal["none", "int8", "int4"]
QUANT_MODES: tuple[str, ...] = get_args(QuantMode)
# Prompt chunks one step may run as graph replays: past a few, one eager pass over all of them costs less than a
# replay each (every replay reads the weights). The server's GPU defaults stop speculating past this many drafters.
MAX_CHUNKS = 4

DENSE_FAMILIES = ("llama", "qwen2", "qwen3", "gemma3")
MOE_FAMILIES = ("qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "gpt_oss")
FAMILIES = DENSE_FAMILIES + MOE_FAMILIES
_HF_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3", "gemma3": "gemma3",
                   **{family: family for family in MOE_FAMILIES}}
Router = Literal["softmax_topk", "topk_softmax"]
ExpertActivation = Literal["silu", "swiglu_clamp"]
GEMMA3_GLOBAL_EVERY = 6
GEMMA3_LOCAL_ROPE_THETA = 10_000.0


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding of one attention kind: base, and an optional scaling (`llama3`, `linear` or `yarn`, with
    transformers' keys)."""

    theta: float
    scaling: dict[str, Any] | None = None


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts feed-forward layer: `top_k` of `num_experts` gated MLPs per token.

    `router`: "softmax_topk" (Qwen-MoE, Mixtral, OLMoE: softmax over every expert, the top k kept, divided by their
    sum when `renormalize`) or "topk_softmax" (gpt-oss: the top k logits, then a softmax over them).
    `activation`: "silu" (SwiGLU) or "swiglu_clamp" (gpt-oss: gate clamped above at `swiglu_limit`, up clamped to
    ±limit, gate * sigmoid(alpha * gate) * (up + 1)). `shared_intermediate` > 0: a shared expert of that width
    beside the routed ones, scaled by sigmoid(shared_expert_gate(x)) (Qwen2-MoE). `dense_layers`: layers whose MLP
    is a plain dense one of `ModelConfig.intermediate_size` (Qwen-MoE's mlp_only_layers / decoder_sparse_step).
    """

    num_experts: int
    top_k: int
    expert_intermediate: int
    router: Router = "softmax_topk"
    renormalize: bool = True
    router_bias: bool = False
    expert_bias: bool = False
    activation: ExpertActivation = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    shared_intermediate: int = 0
    dense_layers: tuple[int, ...] = ()


@dataclass
class ModelConfig:
    is_encoder: ClassVar[bool] = False
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    max_position: int
    rope: RopeConfig
    tie_embeddings: bool = True
    attention_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    embed_scale: float = 1.0
    query_scale: float = 0.0
    sandwich_norms: bool = False  # gemma: extra norms after attention and after the MLP
    sliding_window: int | None = None
    layer_is_sliding: list[bool] = field(default_factory=list)
    local_rope: RopeConfig | None = None
    final_logit_softcap: float | None = None
    moe: MoEConfig | None = None
    qk_norm_per_head: bool = True  # False: OLMoE's q/k norms span all heads' features at once
    o_proj_bias: bool = False      # gpt-oss: the output projection has a bias too
    attention_sinks: bool = False  # gpt-oss: a learned per-head logit joins every softmax (`self_attn.sinks`)

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise UnsupportedModelError(f"unsupported architecture {self.family!r}; supported: {', '.join(FAMILIES)}")
        if not self.query_scale:
            self.query_scale = 1.0 / math.sqrt(self.head_dim)
        if not self.layer_is_sliding:
            self.layer_is_sliding = [False] * self.num_layers



@dataclass(frozen=True)
class EncoderConfig:
    """A BERT-style encoder: learned absolute positions, post-norm layers with LayerNorm, GELU MLP, full attention."""

    is_encoder: ClassVar[bool] = True
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    max_position: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"  # "gelu" (erf, as BERT) or "gelu_tanh"
    pad_token_id: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


ENCODER_FAMILIES = ("bert",)
_ENCODER_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}


def encoder_config_from_hf(cfg: dict[str, Any]) -> EncoderConfig:
    """A BERT encoder's config from its Hugging Face `config.json` dictionary."""
    act = cfg.get("hidden_act", "gelu")
    if act not in _ENCODER_ACTIVATIONS:
        raise UnsupportedModelError(f"unsupported hidden_act {act!r} for bert")
    if cfg.get("position_embedding_type", "absolute") != "absolute":
        raise UnsupportedModelError(f"unsupported position_embedding_type {cfg['position_embedding_type']!r} "
                                    "for bert (only absolute)")
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    if hidden % heads:
        raise UnsupportedModelError(f"hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
    return EncoderConfig(
        family="bert", vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]), num_layers=int(cfg["num_hidden_layers"]), num_heads=heads,
        max_position=int(cfg.get("max_position_embeddings", 512)), type_vocab_size=int(cfg.get("type_vocab_size", 2)),
        layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)), hidden_act=_ENCODER_ACTIVATIONS[act],
        pad_token_id=int(cfg.get("pad_token_id") or 0))


def _gemma3_layer_pattern(num_layers: int) -> list[bool]:
    return [(i + 1) % GEMMA3_GLOBAL_EVERY != 0 for i in range(num_layers)]


# GGUF architectures (llama.cpp's names) → families; llama.cpp converts Mixtral as "llama" with experts.
_GGUF_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3", "qwen3moe": "qwen3_moe",
               "qwen2moe": "qwen2_moe", "olmoe": "olmoe", "gpt-oss": "gpt_oss"}
# The routers' top-k renormalisation llama.cpp hard-codes per architecture (its `norm_w` argument of
# build_moe_ffn), used when a file has no `expert_weights_norm`.
_GGUF_RENORMALIZE = {"qwen3_moe": True, "qwen2_moe": False, "mixtral": True, "olmoe": False}
_GGUF_GATING_SOFTMAX = 1  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX


def _one_width(value: Any, what: str) -> int:
    """A width llama.cpp may store per layer (an array): mixtures of experts here have one for all layers."""
    if isinstance(value, list):
        widths = {int(v) for v in value if int(v)}
        if len(widths) != 1:
            raise UnsupportedModelError(f"{what} differs between layers: {sorted(widths)}")
        return widths.pop()
    return int(value)


def _check_routing(family: str, experts: int, top_k: int) -> None:
    if experts < 1 or not 1 <= top_k <= experts:
        raise UnsupportedModelError(f"{family}: {top_k} experts per token of {experts} is not a mixture of experts")


def _moe_config_from_gguf(family: str, get: Any, common: dict[str, Any], rope: RopeConfig,
                          tensor_names: Collection[str] | None) -> ModelConfig:
    """A mixture-of-experts family's config from GGUF metadata, with llama.cpp's defaults for what it omits."""
    num_layers = common["num_layers"]
    experts, top_k = int(get("expert_count") or 0), int(get("expert_used_count") or 0)
    _check_routing(family, experts, top_k)
    gating = get("expert_gating_func")
    if gating is not None and int(gating) != _GGUF_GATING_SOFTMAX and family != "gpt_oss":
        raise UnsupportedModelError(f"{family}: expert gating function {gating} is not supported (softmax only)")
    # llama.cpp's fallback when the expert width is missing: the dense width shared out among the used experts
    fallback = common["intermediate_size"] if family in ("mixtral", "olmoe", "gpt_oss") \
        else common["intermediate_size"] // top_k
    expert_ff = _one_width(get("expert_feed_forward_length") or fallback, "expert_feed_forward_length")
    names = set(tensor_names) if tensor_names is not None else None
    dense = () if names is None else tuple(i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in names)

    def has(tensor: str, default: bool) -> bool:  # e.g. whether the attention has biases: the file's tensors say
        return default if names is None else f"blk.0.{tensor}" in names

    if family == "gpt_oss":
        window = int(get("attention.sliding_window") or 128)
        return ModelConfig(
            family=family, **common, rope=rope, attention_bias=has("attn_q.bias", True),
            o_proj_bias=has("attn_output.bias", True), attention_sinks=True,
            sliding_window=window, layer_is_sliding=_gguf_sliding_layers(get("attention.sliding_window_pattern"),
                                                                          num_layers),
            moe=MoEConfig(experts, top_k, expert_ff, router="topk_softmax", router_bias=True, expert_bias=True,
                          activation="swiglu_clamp", dense_layers=dense))
    renormalize = bool(get("expert_weights_norm", _GGUF_RENORMALIZE[family]))
    shared = 0
    if family == "qwen2_moe":  # llama.cpp: the shared expert is as wide as the dense MLP unless the file says
        shared = int(get("expert_shared_feed_forward_length") or common["intermediate_size"])
    moe = MoEConfig(experts, top_k, expert_ff, renormalize=renormalize, shared_intermediate=shared,
                    dense_layers=dense)
    return ModelConfig(family=family, **common, rope=rope, moe=moe, qk_norm=family in ("qwen3_moe", "olmoe"),
                       qk_norm_per_head=family != "olmoe", attention_bias=has("attn_q.bias", family == "qwen2_moe"),
                       o_proj_bias=has("attn_output.bias", False))


def _gguf_sliding_layers(pattern: Any, num_layers: int) -> list[bool]:
    """Which layers slide: llama.cpp's `attention.sliding_window_pattern` (a flag per layer, or every n-th layer
    full), by default every other layer from the first (gpt-oss)."""
    if isinstance(pattern, list):
        return [bool(p) for p in pattern]
    n = int(pattern or 2)
    return [n == 0 or i % n < n - 1 for i in range(num_layers)]


def config_from_gguf(meta: dict[str, Any], has_output_tensor: bool,
                     tensor_names: Collection[str] | None = None) -> ModelConfig:
    """Build the config from GGUF metadata; fields the file does not carry take the family defaults.

    `tensor_names` (the file's tensors), when given, tells what the metadata does not: which layers of a mixture
    of experts are dense (no router: `blk.N.ffn_gate_inp`) and whether attention has biases."""
    arch = str(meta.get("general.architecture", ""))
    family = _GGUF_ARCHS.get(arch)

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    if family == "llama" and int(get("expert_count") or 0) > 0:
        family = "mixtral"
    if family is None:
        raise UnsupportedModelError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(_GGUF_ARCHS)}")

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    kv_heads = get("attention.head_count_kv", heads)
    head_dim = int(get("attention.key_length", hidden // heads))
    vocab = get("vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
    num_layers = int(get("block_count"))
    common = dict(
        vocab_size=int(vocab), hidden_size=hidden, intermediate_size=int(get("feed_forward_length")),
        num_layers=num_layers, num_heads=heads, num_kv_heads=int(kv_heads), head_dim=head_dim,
        rms_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)), max_position=int(get("context_length", 4096)),
        tie_embeddings=not has_output_tensor,
    )
    scaling = gguf_rope_scaling(meta, arch)
    if family == "gemma3":
        return ModelConfig(
            family="gemma3", **common, rope=RopeConfig(float(get("rope.freq_base", 1_000_000.0)), scaling),
            local_rope=RopeConfig(GEMMA3_LOCAL_ROPE_THETA), qk_norm=True, hidden_act="gelu_tanh",
            embed_scale=math.sqrt(hidden), query_scale=1.0 / math.sqrt(head_dim), sandwich_norms=True,
            sliding_window=int(get("attention.sliding_window", 512)), layer_is_sliding=_gemma3_layer_pattern(num_layers),
        )
    if family in MOE_FAMILIES:
        rope = RopeConfig(float(get("rope.freq_base", 150_000.0 if family == "gpt_oss" else 10_000.0)), scaling)
        return _moe_config_from_gguf(family, get, common, rope, tensor_names)
    # llama3 frequency scaling travels as the `rope_freqs.weight` tensor in GGUF, applied by the weight loader.
    return ModelConfig(
        family=arch, **common, rope=RopeConfig(float(get("rope.freq_base", 10_000.0)), scaling),
        attention_bias=arch == "qwen2", qk_norm=arch == "qwen3",
    )


# llama.cpp's names of the yarn settings, under `{arch}.rope.scaling.`, and transformers' names for them.
_GGUF_YARN_KEYS = {"yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow",
                   "yarn_log_multiplier": "mscale_all_dim"}
# Families whose yarn ramp is not rounded to whole dimensions (transformers' `truncate`: False in their config.json);
# GGUF has no key for it (llama.cpp always rounds).
_YARN_UNTRUNCATED = ("gpt-oss", "gpt_oss")


def yarn_mscale(factor: float, m: float = 1.0) -> float:
    """YaRN's attention scale for a context `factor` times the trained one (with its `mscale` multiplier m)."""
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def gguf_rope_scaling(meta: dict[str, Any], arch: str) -> dict[str, Any] | None:
    """The `RopeConfig.scaling` of a GGUF's `{arch}.rope.scaling.*` metadata (llama.cpp's keys): linear or yarn
    (factor, original_context_length, the optional yarn_beta_fast / yarn_beta_slow, llama.cpp's defaults 32 and 1,
    yarn_log_multiplier as mscale_all_dim, attn_factor multiplying the attention factor); None for no scaling."""
    def get(key: str) -> Any:
        return meta.get(f"{arch}.rope.scaling.{key}")

    kind, factor = get("type"), get("factor")
    if kind == "linear" and factor:
        return {"rope_type": "linear", "factor": float(factor)}
    if kind != "yarn" or not factor:
        return None
    if get("original_context_length") is None:
        raise UnsupportedModelError(f"{arch}: yarn rope scaling without rope.scaling.original_context_length")
    scaling: dict[str, Any] = {"rope_type": "yarn", "factor": float(factor), "beta_fast": 32.0, "beta_slow": 1.0,
                               "original_max_position_embeddings": int(get("original_context_length"))}
    for key, name in _GGUF_YARN_KEYS.items():
        if get(key) is not None:
            scaling[name] = float(get(key))
    if "mscale_all_dim" in scaling:
        scaling["mscale"] = 1.0  # llama.cpp's reading of yarn_log_multiplier
    extra = float(get("attn_factor") or 1.0)  # llama.cpp multiplies yarn's attention factor by it
    if extra != 1.0:
        factor = scaling["factor"]
        scaling["attention_factor"] = extra * yarn_mscale(factor) / yarn_mscale(factor,
                                                                               scaling.get("mscale_all_dim", 1.0))
    if get("yarn_attn_factor") is not None:  # what the converter writes for a config's own attention_factor
        scaling["attention_factor"] = float(get("yarn_attn_factor"))
    if arch in _YARN_UNTRUNCATED:
        scaling["truncate"] = False
    return scaling


def _hf_rope(cfg: dict[str, Any], kind: str | None, default_theta: float) -> RopeConfig:
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and kind and kind in params:
        params = params[kind]
    if isinstance(params, dict) and "rope_theta" in params:
        theta, scaling = float(params["rope_theta"]), params
    else:
        theta = float(cfg.get("rope_theta", default_theta))
        scaling = params if isinstance(params, dict) and "rope_type" in params else cfg.get("rope_scaling")
    if scaling is not None:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type == "default":
            scaling = None
        elif rope_type not in ("llama3", "linear", "yarn"):
            raise UnsupportedModelError(f"unsupported rope scaling {rope_type!r}")
        else:
            scaling = {k: v for k, v in scaling.items() if k != "rope_theta"} | {"rope_type": rope_type}
    return RopeConfig(theta, scaling)


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig | EncoderConfig:
    """Build the config from a Hugging Face `config.json` dictionary (an EncoderConfig for BERT)."""
    if cfg.get("model_type") in ENCODER_FAMILIES:
        return encoder_config_from_hf(cfg)
    if cfg.get("model_type") == "gemma3" and "text_config" in cfg:
        cfg = {**cfg["text_config"], "model_type": "gemma3_text"}
    model_type = cfg.get("model_type", "")
    family = _HF_MODEL_TYPES.get(model_type)
    if family is None:
        raise UnsupportedModelError(
            f"unsupported model_type {model_type!r} in config.json; supported: "
            f"{', '.join([*_HF_MODEL_TYPES, *ENCODER_FAMILIES])}")
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    num_layers = int(cfg["num_hidden_layers"])
    common = dict(
        vocab_size=int(cfg["vocab_size"]), hidden_size=hidden, intermediate_size=int(cfg["intermediate_size"]),
        num_layers=num_layers, num_heads=heads, num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim, rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position=int(cfg.get("max_position_embeddings", 4096)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", family == "gemma3")),
    )
    if family == "gemma3":
        layer_types = cfg.get("layer_types")
        sliding = ([t == "sliding_attention" for t in layer_types] if layer_types
                   else [(i + 1) % int(cfg.get("sliding_window_pattern", GEMMA3_GLOBAL_EVERY)) != 0
                         for i in range(num_layers)])
        return ModelConfig(
            family="gemma3", **common, rope=_hf_rope(cfg, "full_attention", 1_000_000.0),
            local_rope=RopeConfig(float(cfg.get("rope_local_base_freq", GEMMA3_LOCAL_ROPE_THETA)))
            if "rope_parameters" not in cfg else _hf_rope(cfg, "sliding_attention", GEMMA3_LOCAL_ROPE_THETA),
            qk_norm=True, hidden_act="gelu_tanh", embed_scale=math.sqrt(hidden),
            query_scale=float(cfg.get("query_pre_attn_scalar", head_dim)) ** -0.5, sandwich_norms=True,
            sliding_window=int(cfg.get("sliding_window") or 512), layer_is_sliding=sliding,
            final_logit_softcap=cfg.get("final_logit_softcapping"),
        )
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"unsupported hidden_act {cfg.get('hidden_act')!r} for {family}")
    if family in MOE_FAMILIES:
        return _moe_config_from_hf(family, cfg, common)
    return ModelConfig(
        family=family, **common, rope=_hf_rope(cfg, None, 10_000.0),
        attention_bias=bool(cfg.get("attention_bias", family == "qwen2")), qk_norm=family == "qwen3",
    )


def _sparse_layers_moe(cfg: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """Qwen-MoE's dense layers: those in mlp_only_layers, or off the decoder_sparse_step pattern."""
    step = int(cfg.get("decoder_sparse_step") or 1)
    only = set(cfg.get("mlp_only_layers") or ())
    return tuple(i for i in range(num_layers) if i in only or (i + 1) % step)


def _moe_config_from_hf(family: str, cfg: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    """The config of a mixture-of-experts family from its Hugging Face `config.json` dictionary."""
    num_layers = common["num_layers"]
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    top_k = int(cfg.get("num_experts_per_tok") or cfg.get("experts_per_token") or 0)
    _check_routing(family, experts, top_k)
    rope = _hf_rope(cfg, None, 10_000.0 if family != "gpt_oss" else 150_000.0)
    if family in ("qwen3_moe", "qwen2_moe"):
        moe = MoEConfig(experts, top_k, int(cfg["moe_intermediate_size"]), renormalize=bool(cfg.get("norm_topk_prob")),
                        shared_intermediate=int(cfg.get("shared_expert_intermediate_size") or 0)
                        if family == "qwen2_moe" else 0,
                        dense_layers=_sparse_layers_moe(cfg, num_layers))
        return ModelConfig(family=family, **common, rope=rope, moe=moe, qk_norm=family == "qwen3_moe",
                           attention_bias=bool(cfg.get("qkv_bias", True)) if family == "qwen2_moe"
                           else bool(cfg.get("attention_bias", False)))
    if family == "mixtral":
        window = cfg.get("sliding_window")
        return ModelConfig(family=family, **common, rope=rope,
                           moe=MoEConfig(experts, top_k, int(cfg["intermediate_size"])),
                           sliding_window=int(window) if window else None,
                           layer_is_sliding=[bool(window)] * num_layers)
    if family == "olmoe":
        if cfg.get("clip_qkv") is not None:
            raise UnsupportedModelError("olmoe with clip_qkv is not supported")
        bias = bool(cfg.get("attention_bias", False))
        return ModelConfig(family=family, **common, rope=rope, qk_norm=True, qk_norm_per_head=False,
                           attention_bias=bias, o_proj_bias=bias,
                           moe=MoEConfig(experts, top_k, int(cfg["intermediate_size"]),
                                         renormalize=bool(cfg.get("norm_topk_prob", False))))
    # gpt_oss
    layer_types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                             for i in range(num_layers)]
    bias = bool(cfg.get("attention_bias", True))
    return ModelConfig(
        family=family, **common, rope=rope, attention_bias=bias, o_proj_bias=bias, attention_sinks=True,
        sliding_window=int(cfg.get("sliding_window") or 128),
        layer_is_sliding=[t == "sliding_attention" for t in layer_types],
        moe=MoEConfig(experts, top_k, int(cfg["intermediate_size"]), router="topk_softmax", router_bias=True,
                      expert_bias=True, activation="swiglu_clamp",
                      swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
                      swiglu_limit=float(cfg.get("swiglu_limit", 7.0))))
