"""Validates tests/support/tiny_models.py's GGUF writer independently of emberserve.

transformers has its own GGUF reader for llama, qwen2, qwen3 and gemma3 that undoes llama.cpp's
layout (the llama Q/K permutation, gemma's `1 + w` norms, the tensor names). Loading our GGUF with
it and getting the original model's logits back proves the file is in llama.cpp's layout.

`AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` needs `accelerate`, which is not a
dependency of this project, so `_load_with_transformers` runs the same steps itself: the config from
`AutoConfig.from_pretrained(dir, gguf_file=...)`, then the tensors from transformers'
`load_gguf_checkpoint(..., model_to_load=model)`, which is what from_pretrained's GGUF path calls
for these architectures.

Where transformers' reader does not read something llama.cpp's file carries, the config is patched
and the part is checked another way:
  * llama3 rope scaling: transformers ignores the `rope_freqs` tensor (and llama.cpp writes no
    scaling keys for llama3), so the config comes back unscaled. `rope_freqs` is checked against
    transformers' own llama3 inverse frequencies, and logits are compared with the scaling restored.
  * qwen3 head_dim: transformers' qwen3 GGUF mapping has no `attention.key_length`, so it falls back
    to Qwen3Config's default 128; patched from `qwen3.attention.key_length` (checked equal to ours).
  * gemma3 query_pre_attn_scalar: not in GGUF files at all; transformers defaults to 256, llama.cpp
    scales by 1/sqrt(key_length). Patched to key_length.
"""

import filecmp
import re

import gguf
import numpy as np
import pytest
import torch

from tests.support import tiny_models as tm
from tests.support.tiny_models import GGUF_TYPES, MOE_VARIANTS, VARIANTS, hf_greedy, hf_logits, prompt_ids

_LONG = 36  # tokens: past gemma3's sliding window of 8, and far enough for rope scaling to matter


def _long_ids(tiny):
    return prompt_ids(tiny, 0, _LONG)


def _read_fields(path) -> dict:
    reader = gguf.GGUFReader(str(path))
    return reader, {name: field.contents() for name, field in reader.fields.items()}


def _config_patch(tiny, fields) -> dict:
    fam = tiny.family
    if tiny.variant == "llama3_scaled":
        return {"rope_parameters": dict(tiny.config.rope_parameters)}
    if fam == "qwen3":
        return {"head_dim": fields["qwen3.attention.key_length"]}
    if fam == "gemma3":
        return {"query_pre_attn_scalar": fields["gemma3.attention.key_length"]}
    return {}


def _load_with_transformers(path, patch: dict, fix=None):
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    for key, value in patch.items():
        setattr(config, key, value)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    parsed = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)
    tensors = parsed["tensors"]
    if fix is not None:  # what transformers' reader gets wrong or leaves out (see the mixture-of-experts tests)
        fix(tensors)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    assert not unexpected, f"GGUF tensors transformers could not place: {unexpected}"
    assert set(missing) <= tied, f"model weights the GGUF did not provide (wrong names?): {missing}"
    return model.eval(), config


# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_transformers_loads_our_f32_gguf_with_identical_logits(tiny_zoo, variant):
    tiny = tiny_zoo.model(variant)
    path = tiny_zoo.gguf(variant, "F32")
    _, fields = _read_fields(path)
    model, config = _load_with_transformers(path, _config_patch(tiny, fields))

    # the config transformers rebuilt from our metadata is the original one
    orig = tiny.config
    for key in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "max_position_embeddings", "tie_word_embeddings"):
        assert getattr(config, key) == getattr(orig, key), key
    assert config.rms_norm_eps == pytest.approx(orig.rms_norm_eps, rel=1e-6)
    assert tm._head_dim(config) == tm._head_dim(orig)
    assert config.rope_parameters == orig.rope_parameters
    if tiny.family == "gemma3":
        assert config.sliding_window == orig.sliding_window
        assert config.layer_types == orig.layer_types
        assert config.hidden_activation == orig.hidden_activation

    ids = _long_ids(tiny)
    expected = hf_logits(tiny.hf_model, ids)
    got = hf_logits(model, ids)
    # F32 everywhere, so equal up to gemma's (1 + w) - 1 rounding and eps stored as float32
    assert float((got - expected).abs().max()) < 1e-5 * max(1.0, float(expected.abs().max()))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("gguf_type", GGUF_TYPES[1:])
def test_transformers_loads_our_quantized_gguf_as_the_roundtripped_reference(tiny_zoo, variant, gguf_type):
    """transformers dequantizes our F16/BF16/Q* file to exactly `reference_model`'s weights."""
    tiny = tiny_zoo.model(variant)
    path = tiny_zoo.gguf(variant, gguf_type)
    reader, fields = _read_fields(path)
    assert fields["general.file_type"] == int(tm._FILE_TYPE[gguf_type])
    for tensor in reader.tensors:
        want = gguf_type if (len(tensor.shape) == 2 and not tensor.name.endswith("norm.weight")) else "F32"
        assert tensor.tensor_type.name == want, tensor.name
    model, _ = _load_with_transformers(path, _config_patch(tiny, fields))
    ref = tiny_zoo.reference(variant, gguf_type)
    for name, param in ref.state_dict().items():
        loaded = model.state_dict()[name]
        if tiny.family == "gemma3" and name.endswith("norm.weight"):
            torch.testing.assert_close(loaded, param, rtol=0, atol=1e-7)  # (1 + w) - 1 in F32
        else:
            assert torch.equal(loaded, param), f"{name}: max diff {(loaded - param).abs().max():.3e}"
    if gguf_type != "BF16":  # quantization really changed the weights
        assert not torch.equal(ref.model.embed_tokens.weight, tiny.hf_model.model.embed_tokens.weight)


@pytest.mark.parametrize("variant", VARIANTS)
def test_gguf_metadata_and_tensor_layout(tiny_zoo, variant):
    tiny = tiny_zoo.model(variant)
    cfg = tiny.config
    reader, f = _read_fields(tiny_zoo.gguf(variant, "F32"))
    arch = tiny.family
    assert f["general.architecture"] == arch
    head_dim = tm._head_dim(cfg)
    expect = {
        "block_count": cfg.num_hidden_layers,
        "context_length": cfg.max_position_embeddings,
        "embedding_length": cfg.hidden_size,
        "feed_forward_length": cfg.intermediate_size,
        "attention.head_count": cfg.num_attention_heads,
        "attention.head_count_kv": cfg.num_key_value_heads,
        "rope.dimension_count": head_dim,
    }
    if head_dim != cfg.hidden_size // cfg.num_attention_heads or arch == "gemma3":
        expect["attention.key_length"] = expect["attention.value_length"] = head_dim
    else:
        assert f"{arch}.attention.key_length" not in f
    if arch == "gemma3":
        expect["attention.sliding_window"] = cfg.sliding_window
        base = cfg.rope_parameters["full_attention"]["rope_theta"]
        assert cfg.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0  # llama.cpp's fixed local base
    else:
        base = cfg.rope_parameters["rope_theta"]
    for key, value in expect.items():
        assert f[f"{arch}.{key}"] == value, key
    assert f[f"{arch}.rope.freq_base"] == pytest.approx(base)
    assert f[f"{arch}.attention.layer_norm_rms_epsilon"] == pytest.approx(cfg.rms_norm_eps, rel=1e-6)

    # tokenizer: the same vocabulary and merges as tokenizer.json
    tokens, types, merges = tm._gguf_vocab(tiny.safetensors_dir / "tokenizer.json")
    assert f["tokenizer.ggml.model"] == "gpt2" and f["tokenizer.ggml.pre"] == "gpt2"
    assert f["tokenizer.ggml.tokens"] == tokens and len(tokens) == cfg.vocab_size
    assert f["tokenizer.ggml.token_type"] == types and f["tokenizer.ggml.merges"] == merges
    assert f["tokenizer.ggml.bos_token_id"] == tiny.bos_token_id == cfg.bos_token_id
    assert f["tokenizer.ggml.eos_token_id"] == tiny.eos_token_id == cfg.eos_token_id
    assert f["tokenizer.ggml.add_bos_token"] == tiny.add_bos

    # tensors: llama.cpp's names, F32, shapes in ggml order (fastest dimension first)
    L = cfg.num_hidden_layers
    per_block = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "ffn_norm"]
    if arch == "qwen2":
        per_block += ["attn_q.bias", "attn_k.bias", "attn_v.bias"]
    if arch in ("qwen3", "gemma3"):
        per_block += ["attn_q_norm", "attn_k_norm"]
    if arch == "gemma3":
        per_block += ["post_attention_norm", "post_ffw_norm"]
    names = {"token_embd.weight", "output_norm.weight"}
    names |= {f"blk.{i}.{n}" if n.endswith(".bias") else f"blk.{i}.{n}.weight" for i in range(L) for n in per_block}
    if not cfg.tie_word_embeddings:
        names.add("output.weight")
    if variant == "llama3_scaled":
        names.add("rope_freqs.weight")
    by_name = {t.name: t for t in reader.tensors}
    assert set(by_name) == names
    for t in reader.tensors:
        assert t.tensor_type == gguf.GGMLQuantizationType.F32, t.name
    H = cfg.hidden_size
    assert list(by_name["token_embd.weight"].shape) == [H, cfg.vocab_size]
    assert list(by_name["blk.0.attn_q.weight"].shape) == [H, cfg.num_attention_heads * head_dim]
    assert list(by_name["blk.0.attn_k.weight"].shape) == [H, cfg.num_key_value_heads * head_dim]
    assert list(by_name["blk.0.ffn_down.weight"].shape) == [cfg.intermediate_size, H]


def _raw_tensor(reader, name) -> np.ndarray:
    t = next(t for t in reader.tensors if t.name == name)
    return np.asarray(t.data).reshape(list(reversed([int(d) for d in t.shape])))


@pytest.mark.parametrize("variant", VARIANTS)
def test_llama_permutation_and_gemma_norm_offset_as_llama_cpp(tiny_zoo, variant):
    """Byte-level: only llama's attn_q/attn_k rows are permuted, only gemma3's norms are 1 + w."""
    tiny = tiny_zoo.model(variant)
    cfg = tiny.config
    reader, _ = _read_fields(tiny_zoo.gguf(variant, "F32"))
    sd = tiny.hf_model.state_dict()
    q, k = sd["model.layers.1.self_attn.q_proj.weight"], sd["model.layers.1.self_attn.k_proj.weight"]
    gq, gk = (torch.from_numpy(_raw_tensor(reader, f"blk.1.{n}.weight").copy()) for n in ("attn_q", "attn_k"))
    if tiny.family == "llama":
        n_head, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        d = tm._head_dim(cfg)
        # llama.cpp: row (h, i, half) of HF's [first half | second half] becomes (h, i, pair slot)
        perm = torch.arange(n_head * d).reshape(n_head, 2, d // 2).transpose(1, 2).reshape(-1)
        assert torch.equal(gq, q[perm])
        perm_k = torch.arange(n_kv * d).reshape(n_kv, 2, d // 2).transpose(1, 2).reshape(-1)
        assert torch.equal(gk, k[perm_k])
        assert not torch.equal(gq, q)
    else:
        assert torch.equal(gq, q) and torch.equal(gk, k)
    for hf_name, tensor in sd.items():
        if hf_name.endswith("norm.weight"):
            raw = torch.from_numpy(_raw_tensor(reader, tm._gguf_tensor_name(hf_name, tiny.family)).copy())
            assert torch.equal(raw, tensor + 1 if tiny.family == "gemma3" else tensor), hf_name


@pytest.mark.parametrize("variant,skip", [("llama_tied", "_permute"), ("gemma3", "_gemma_norm_offset")])
def test_transformers_check_catches_layout_mistakes(tiny_zoo, tmp_path, variant, skip):
    """Negative control: a file without the permutation / the +1 does NOT reproduce the logits."""
    tiny = tiny_zoo.model(variant)
    path = tm.write_gguf(tiny, "F32", tmp_path / f"bad-{variant}.gguf", **{skip: False})
    _, fields = _read_fields(path)
    model, _ = _load_with_transformers(path, _config_patch(tiny, fields))
    ids = _long_ids(tiny)
    assert float((hf_logits(model, ids) - hf_logits(tiny.hf_model, ids)).abs().max()) > 0.1


def test_rope_freqs_are_transformers_llama3_scaling(tiny_zoo):
    tiny = tiny_zoo.model("llama3_scaled")
    reader, fields = _read_fields(tiny_zoo.gguf("llama3_scaled", "F32"))
    factors = torch.from_numpy(_raw_tensor(reader, "rope_freqs.weight").copy())
    assert factors.dtype == torch.float32
    rope = tiny.config.rope_parameters
    dim = tm._head_dim(tiny.config)
    base_inv = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    hf_inv = tiny.hf_model.model.rotary_emb.inv_freq.float()
    # llama.cpp divides each frequency by its factor; that must be transformers' llama3 frequency
    torch.testing.assert_close(base_inv / factors, hf_inv, rtol=1e-6, atol=0)
    # all three of llama3's bands are exercised: unscaled, fully scaled, and smoothed in between
    assert (factors == 1).any() and (factors == rope["factor"]).any()
    assert ((factors > 1) & (factors < rope["factor"])).any()
    # and the scaling is visible in the logits: without it transformers' load gives other logits
    unscaled, _ = _load_with_transformers(tiny_zoo.gguf("llama3_scaled", "F32"), {})
    ids = _long_ids(tiny)
    assert float((hf_logits(unscaled, ids) - hf_logits(tiny.hf_model, ids)).abs().max()) > 0.01


@pytest.mark.parametrize("variant", VARIANTS)
def test_gguf_tokenizer_loads_in_transformers_and_matches_tokenizer_json(tiny_zoo, variant):
    from transformers import AutoTokenizer

    tiny = tiny_zoo.model(variant)
    path = tiny_zoo.gguf(variant, "F32")
    ours = AutoTokenizer.from_pretrained(str(tiny.safetensors_dir))
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    specials = " ".join(tm._SPEC[variant].special)
    for text in tm.PROMPTS + [f"{specials} mixed with text 42!", "  two spaces\nand a newline\t tab"]:
        assert ours(text).input_ids == theirs(text).input_ids, text
    assert ours.bos_token_id == theirs.bos_token_id == tiny.bos_token_id
    assert ours.eos_token_id == theirs.eos_token_id == tiny.eos_token_id
    assert ours.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)


def test_gemma3_fixture_exercises_sliding_window(tiny_zoo):
    tiny = tiny_zoo.model("gemma3")
    cfg = tiny.config
    assert cfg.layer_types[5] == "full_attention"
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == [5]
    assert cfg.query_pre_attn_scalar == cfg.head_dim and cfg.sliding_window == 8
    ids = _long_ids(tiny)
    wide = tm.copy.deepcopy(tiny.hf_model)
    wide.config.sliding_window = 4096
    for layer in wide.model.layers:
        layer.self_attn.sliding_window = 4096 if layer.self_attn.sliding_window else None
    a, b = hf_logits(tiny.hf_model, ids), hf_logits(wide, ids)
    assert torch.equal(a[:8], b[:8])  # inside the window nothing changes
    assert float((a[8:] - b[8:]).abs().max()) > 0.01  # past it, the window matters


@pytest.mark.parametrize("variant", VARIANTS)
def test_reference_greedy_continuation_is_unambiguous(tiny_zoo, variant):
    """The parity tests compare greedy tokens; HF's top-2 logits along them are never near a tie."""
    tiny = tiny_zoo.model(variant)
    prompt = prompt_ids(tiny, 0)
    cont, logits = hf_greedy(tiny.hf_model, prompt, 16)
    top2 = logits[len(prompt) - 1 : -1].topk(2, dim=-1).values
    assert float((top2[:, 0] - top2[:, 1]).min()) > 2e-3
    assert len(set(cont)) >= 4, cont  # not one token repeated
    assert not set(cont) & set(range(len(tm._SPEC[variant].special))), "special token in continuation"


def test_build_is_deterministic(tiny_zoo, tmp_path):
    for variant in ("llama3_scaled", "gemma3"):
        again = tm.build_tiny_model(variant, tmp_path)
        first = tiny_zoo.model(variant)
        for (n1, t1), (n2, t2) in zip(first.hf_model.state_dict().items(), again.hf_model.state_dict().items()):
            assert n1 == n2 and torch.equal(t1, t2), n1
        assert filecmp.cmp(again.gguf_path, tiny_zoo.gguf(variant, "F32"), shallow=False)
        assert filecmp.cmp(again.safetensors_dir / "tokenizer.json", first.safetensors_dir / "tokenizer.json", shallow=False)


# ---------------------------------------------------------------------------------------------------
# Mixtures of experts.
#
# transformers reads qwen3moe and qwen2moe GGUFs (its Qwen2MoeTensorProcessor); not Mixtral's (llama with
# experts), OLMoE's, nor gpt-oss's (its processor expects tensor names llama.cpp does not write). Those are checked
# byte for byte against the safetensors checkpoint instead, through the converter's documented transformations.
# Where transformers' reader falls short of what llama.cpp writes, the test says so and fixes that one thing:
#   * the expert widths (`expert_feed_forward_length`, `expert_shared_feed_forward_length`) are not in its
#     mappings, nor Qwen3-MoE's dense layers (no GGUF key): patched from the config;
#   * the dense MLP of a Qwen3-MoE dense layer (`blk.1.ffn_gate` ...) is not in gguf-py's qwen3moe layout, so not
#     in transformers' name map either: placed from gguf-py's reader;
#   * Qwen2-MoE's shared-expert gate: the converter writes it [1, H] as the checkpoint has it; transformers adds
#     a dimension (for the 1-D one the older converter's squeeze wrote): taken back off.

TRANSFORMERS_MOE = ["qwen3_moe", "qwen2_moe"]


def _moe_patch(tiny) -> dict:
    cfg = tiny.config
    patch = {"moe_intermediate_size": cfg.moe_intermediate_size}
    if tiny.family == "qwen2_moe":
        patch["shared_expert_intermediate_size"] = cfg.shared_expert_intermediate_size
    if tiny.family == "qwen3_moe":
        patch["mlp_only_layers"] = list(cfg.mlp_only_layers)
    return patch


def _moe_fix(reader):
    dense = {}
    for t in reader.tensors:
        if m := re.fullmatch(r"blk\.(\d+)\.ffn_(gate|up|down)\.weight", t.name):
            dense[f"model.layers.{m[1]}.mlp.{m[2]}_proj.weight"] = torch.from_numpy(
                gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).copy())

    def fix(tensors):
        for name in list(tensors):
            if name.endswith("shared_expert_gate.weight"):
                tensors[name] = tensors[name].reshape(1, -1)
        tensors.update(dense)

    return fix


@pytest.mark.parametrize("gguf_type", ["F32", "Q8_0", "Q4_0"])
@pytest.mark.parametrize("variant", TRANSFORMERS_MOE)
def test_transformers_loads_our_moe_gguf_as_the_roundtripped_reference(tiny_zoo, variant, gguf_type):
    """transformers' GGUF loader rebuilds the tiny MoE's config and exactly `reference_model`'s weights, experts
    (gate and up split from its fused stacks) included."""
    tiny = tiny_zoo.model(variant)
    path = tiny_zoo.gguf(variant, gguf_type)
    reader, _ = _read_fields(path)
    model, config = _load_with_transformers(path, _moe_patch(tiny), _moe_fix(reader))
    orig = tiny.config
    for key in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "vocab_size", "num_experts", "num_experts_per_tok", "norm_topk_prob", "tie_word_embeddings"):
        assert getattr(config, key) == getattr(orig, key), key
    assert tm._head_dim(config) == tm._head_dim(orig)
    ref = tiny_zoo.reference(variant, gguf_type)
    loaded = model.state_dict()
    for name, param in ref.state_dict().items():
        assert torch.equal(loaded[name], param), f"{name}: max diff {(loaded[name] - param).abs().max():.3e}"
    if gguf_type != "F32":  # quantization really changed the experts
        experts = "model.layers.0.mlp.experts.gate_up_proj"
        assert not torch.equal(ref.state_dict()[experts], tiny.hf_model.state_dict()[experts])
    ids = _long_ids(tiny)
    want = hf_logits(ref, ids)
    assert float((hf_logits(model, ids) - want).abs().max()) < 1e-5 * max(1.0, float(want.abs().max()))


def _checkpoint(tiny) -> dict[str, torch.Tensor]:
    """The safetensors file as transformers saved it (the per-expert or gpt-oss layout llama.cpp converts)."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(tiny.safetensors_dir.glob("*.safetensors")):
        out |= load_file(str(f))
    return out


def _converted_experts(tiny, layer: int) -> dict[str, torch.Tensor]:
    """What llama.cpp's converter makes of one layer's experts in the checkpoint (Qwen2MoeModel / OlmoeModel /
    LlamaModel.modify_tensors: per-expert tensors stacked; GptOssModel: stacks transposed, gate/up interleave
    split), by GGUF name."""
    ck = _checkpoint(tiny)
    p = f"model.layers.{layer}."
    if tiny.family == "gpt_oss":
        gate_up, bias = ck[f"{p}mlp.experts.gate_up_proj"].transpose(-1, -2), ck[f"{p}mlp.experts.gate_up_proj_bias"]
        return {"ffn_gate_exps.weight": gate_up[:, ::2, :], "ffn_up_exps.weight": gate_up[:, 1::2, :],
                "ffn_down_exps.weight": ck[f"{p}mlp.experts.down_proj"].transpose(-1, -2),
                "ffn_gate_exps.bias": bias[..., ::2], "ffn_up_exps.bias": bias[..., 1::2],
                "ffn_down_exps.bias": ck[f"{p}mlp.experts.down_proj_bias"],
                "ffn_gate_inp.weight": ck[f"{p}mlp.router.weight"], "ffn_gate_inp.bias": ck[f"{p}mlp.router.bias"]}
    n = tiny.config.num_local_experts if tiny.family == "mixtral" else tiny.config.num_experts
    if tiny.family == "mixtral":
        names, router = {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}, "block_sparse_moe.gate"
        expert = f"{p}block_sparse_moe.experts.{{e}}.{{w}}.weight"
    else:
        names, router = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}, \
            "mlp.gate"
        expert = f"{p}mlp.experts.{{e}}.{{w}}.weight"
    out = {f"{g}.weight": torch.stack([ck[expert.format(e=e, w=w)] for e in range(n)]) for w, g in names.items()}
    out["ffn_gate_inp.weight"] = ck[f"{p}{router}.weight"]
    if tiny.family == "qwen2_moe":
        for w in ("gate", "up", "down"):
            out[f"ffn_{w}_shexp.weight"] = ck[f"{p}mlp.shared_expert.{w}_proj.weight"]
        out["ffn_gate_inp_shexp.weight"] = ck[f"{p}mlp.shared_expert_gate.weight"]
    return out


def _moe_block_names(tiny, layer: int) -> set[str]:
    family = tiny.family
    names = {"attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight"}
    names.add("post_attention_norm.weight" if family == "gpt_oss" else "ffn_norm.weight")
    if family in ("qwen3_moe", "olmoe"):
        names |= {"attn_q_norm.weight", "attn_k_norm.weight"}
    if family in ("qwen2_moe", "gpt_oss"):
        names |= {"attn_q.bias", "attn_k.bias", "attn_v.bias"}
    if family == "gpt_oss":
        names |= {"attn_output.bias", "attn_sinks.weight"}
    if layer in (getattr(tiny.config, "mlp_only_layers", None) or []):
        return names | {"ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"}
    return names | set(_converted_experts(tiny, layer))


@pytest.mark.parametrize("variant", MOE_VARIANTS)
def test_moe_gguf_layout_is_the_converters_from_the_checkpoint(tiny_zoo, variant):
    """llama.cpp's architecture, MoE keys, tensor names and the expert stacks' bytes: what its converter makes of
    the safetensors checkpoint (per-expert tensors stacked [E, out, in], ne = [in, out, E])."""
    tiny = tiny_zoo.model(variant)
    cfg = tiny.config
    reader, f = _read_fields(tiny_zoo.gguf(variant, "F32"))
    arch = tm.gguf_arch(tiny)
    assert f["general.architecture"] == arch == {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama",
                                                 "olmoe": "olmoe", "gpt_oss": "gpt-oss"}[variant]
    experts = cfg.num_local_experts if variant in ("mixtral", "gpt_oss") else cfg.num_experts
    assert (f[f"{arch}.expert_count"], f[f"{arch}.expert_used_count"]) == (experts, cfg.num_experts_per_tok)
    if variant in ("qwen3_moe", "qwen2_moe"):
        assert f[f"{arch}.expert_feed_forward_length"] == cfg.moe_intermediate_size
    if variant == "qwen2_moe":
        assert f[f"{arch}.expert_shared_feed_forward_length"] == cfg.shared_expert_intermediate_size
    if variant == "gpt_oss":
        rope = cfg.rope_parameters
        assert f[f"{arch}.attention.sliding_window"] == cfg.sliding_window
        assert f[f"{arch}.expert_feed_forward_length"] == cfg.intermediate_size
        assert (f[f"{arch}.rope.scaling.type"], f[f"{arch}.rope.scaling.factor"]) == ("yarn", rope["factor"])
        assert f[f"{arch}.rope.scaling.original_context_length"] == rope["original_max_position_embeddings"]
        assert (f[f"{arch}.rope.scaling.yarn_beta_fast"], f[f"{arch}.rope.scaling.yarn_beta_slow"]) == \
            (rope["beta_fast"], rope["beta_slow"])
    by_name = {t.name: t for t in reader.tensors}
    want = {"token_embd.weight", "output_norm.weight", "output.weight"}
    want |= {f"blk.{i}.{n}" for i in range(cfg.num_hidden_layers) for n in _moe_block_names(tiny, i)}
    assert set(by_name) == want
    for i in range(cfg.num_hidden_layers):
        if f"blk.{i}.ffn_gate_inp.weight" not in by_name:
            continue
        for name, tensor in _converted_experts(tiny, i).items():
            t = by_name[f"blk.{i}.{name}"]
            assert [int(d) for d in t.shape] == list(reversed(tensor.shape)), name  # ggml order
            assert torch.equal(torch.from_numpy(_raw_tensor(reader, t.name).copy()).reshape(tensor.shape), tensor)


@pytest.mark.parametrize("variant,gguf_type", [(v, "Q8_0") for v in MOE_VARIANTS] + [("gpt_oss", "MXFP4")])
def test_moe_quantized_copies_quantize_the_experts_and_keep_routers_f32(tiny_zoo, variant, gguf_type):
    """As the converter: every matrix and expert stack in the type (F16 where its rows are not whole blocks),
    routers, the shared-expert gate, norms, biases and sinks F32; MXFP4 only for the experts."""
    reader, f = _read_fields(tiny_zoo.gguf(variant, gguf_type))
    assert f["general.file_type"] == int(tm._FILE_TYPE[gguf_type])
    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[gguf_type]][0]
    seen = set()
    for t in reader.tensors:
        matrix = len(t.shape) >= 2 and t.name.endswith(".weight") and not t.name.endswith("norm.weight")
        router = ".ffn_gate_inp" in t.name
        if not matrix or router or (gguf_type == "MXFP4" and "_exps" not in t.name):
            want = "F32"
        else:
            want = gguf_type if int(t.shape[0]) % block == 0 else "F16"
        assert t.tensor_type.name == want, t.name
        seen.add(want)
    assert gguf_type in seen and "F32" in seen
