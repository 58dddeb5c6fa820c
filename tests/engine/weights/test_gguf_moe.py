"""Mixtures of experts from GGUF: configs from llama.cpp's metadata, expert stacks read an expert at a time.

References: the tiny models' config.json (read by the safetensors path), gguf-py's own reader and dequantizers,
and transformers' GGUF loader on random K-quant files (tests/support/moe_gguf.py), which the tiny models cannot
cover (gguf-py does not quantize K-quants, and their rows need 256 inputs).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize as ref_dequantize

from engine import load_runner
from engine.config import config_from_gguf, config_from_hf
from engine.model.quant import Affine4Bit
from engine.model.quant.mxfp4 import Mxfp4Tensor
from engine.weights.gguf import load_gguf
from engine.weights.gguf_format import GGUFFile
from engine.weights.lazy_experts import LazyExperts
from tests.support.moe_gguf import write_random_moe_gguf
from tests.support.tiny_models import MOE_VARIANTS

EXPERT_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q5_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "MXFP4"]
FOUR_BIT = {"Q4_0", "Q4_1", "Q4_K"}  # the types whose blocks are exact Affine4Bit codes
_CLASS = {"float": torch.Tensor, "affine4bit": Affine4Bit, "mxfp4": Mxfp4Tensor}


def _form(expert_type: str, keep_4bit: bool) -> str:
    if expert_type == "MXFP4":  # gpt-oss's own format stays exact whatever the mode
        return "mxfp4"
    return "affine4bit" if keep_4bit and expert_type in FOUR_BIT else "float"


def _dense(w) -> torch.Tensor:
    return w if isinstance(w, torch.Tensor) else w.dequantize()


@pytest.mark.parametrize("variant", MOE_VARIANTS)
def test_gguf_config_equals_the_config_json_one(tiny_zoo, variant):
    """Everything a mixture of experts' config.json says is read back from llama.cpp's metadata and tensor names:
    expert counts and widths, dense layers, renormalisation, shared expert, biases, sinks, sliding layers, yarn."""
    tiny = tiny_zoo.model(variant)
    gguf = GGUFFile(tiny_zoo.gguf(variant))
    from_gguf = config_from_gguf(gguf.metadata, "output.weight" in gguf.tensors, gguf.tensors.keys())
    from_hf = config_from_hf(json.loads((tiny.safetensors_dir / "config.json").read_text()))
    assert from_gguf.rms_eps == pytest.approx(from_hf.rms_eps, rel=1e-6)  # stored as float32
    assert dataclasses.replace(from_gguf, rms_eps=from_hf.rms_eps) == from_hf
    assert from_gguf.moe is not None and from_gguf.moe.num_experts > from_gguf.moe.top_k


def _moe_metadata(arch: str, **extra) -> dict:
    meta = {"general.architecture": arch, f"{arch}.embedding_length": 64, f"{arch}.attention.head_count": 4,
            f"{arch}.block_count": 4, f"{arch}.feed_forward_length": 96, f"{arch}.vocab_size": 100}
    return meta | {f"{arch}.{k}": v for k, v in extra.items()}


def test_llama_with_experts_is_mixtral_and_without_is_llama():
    dense = config_from_gguf(_moe_metadata("llama"), True)
    assert dense.family == "llama" and dense.moe is None
    mixtral = config_from_gguf(_moe_metadata("llama", expert_count=8, expert_used_count=2), True)
    assert mixtral.family == "mixtral"
    assert (mixtral.moe.num_experts, mixtral.moe.top_k, mixtral.moe.expert_intermediate) == (8, 2, 96)
    assert mixtral.moe.renormalize  # llama.cpp's llama graph renormalises the top k


def test_llama_cpp_defaults_for_what_the_metadata_omits():
    """llama.cpp's own fallbacks: renormalisation per architecture, the expert width n_ff / n_expert_used for
    Qwen-MoE, the shared expert as wide as the dense MLP; `expert_weights_norm` when a file has it."""
    qwen3 = config_from_gguf(_moe_metadata("qwen3moe", expert_count=8, expert_used_count=2), True)
    assert qwen3.moe.renormalize and qwen3.moe.expert_intermediate == 48
    qwen2 = config_from_gguf(_moe_metadata("qwen2moe", expert_count=8, expert_used_count=2), True)
    assert not qwen2.moe.renormalize and qwen2.moe.shared_intermediate == 96 and qwen2.attention_bias
    olmoe = config_from_gguf(_moe_metadata("olmoe", expert_count=8, expert_used_count=2, expert_weights_norm=True), True)
    assert olmoe.moe.renormalize and olmoe.qk_norm and not olmoe.qk_norm_per_head


def test_gpt_oss_sliding_layers_from_the_pattern_key():
    default = config_from_gguf(_moe_metadata("gpt-oss", expert_count=4, expert_used_count=2), True)
    assert default.layer_is_sliding == [True, False, True, False]  # llama.cpp's pattern 2: every other layer
    assert default.moe.router == "topk_softmax" and default.attention_sinks and default.o_proj_bias
    flags = config_from_gguf(_moe_metadata("gpt-oss", expert_count=4, expert_used_count=2,
                                           **{"attention.sliding_window_pattern": [False, True, True, False]}), True)
    assert flags.layer_is_sliding == [False, True, True, False]


def test_dense_layers_are_those_without_a_router():
    meta = _moe_metadata("qwen3moe", expert_count=8, expert_used_count=2)
    names = {f"blk.{i}.ffn_gate_inp.weight" for i in (0, 2)} | {"blk.1.ffn_gate.weight", "blk.3.ffn_gate.weight"}
    assert config_from_gguf(meta, True, names).moe.dense_layers == (1, 3)


@pytest.fixture(scope="module")
def random_files(tmp_path_factory):
    """expert type → a random Qwen3-MoE GGUF with its experts in that type."""
    root = tmp_path_factory.mktemp("random_moe")
    return {t: write_random_moe_gguf(root / f"{t}.gguf", expert_type=t, layers=1, experts=4, seed=i)
            for i, t in enumerate(EXPERT_TYPES)}


@pytest.mark.parametrize("keep_4bit", [False, True])
@pytest.mark.parametrize("expert_type", EXPERT_TYPES)
def test_expert_stacks_read_an_expert_at_a_time_as_gguf_dequantizes_them(random_files, expert_type, keep_4bit):
    path = random_files[expert_type]
    _, state, _, _ = load_gguf(path, keep_4bit=keep_4bit)
    reader = {t.name: t for t in GGUFReader(str(path)).tensors}
    for projection, name in (("gate_proj", "ffn_gate_exps"), ("down_proj", "ffn_down_exps")):
        stack = state[f"layers.0.mlp.experts.{projection}"]
        t = reader[f"blk.0.{name}.weight"]
        want = torch.from_numpy(ref_dequantize(t.data, t.tensor_type).astype(np.float32))
        want = want.reshape(*reversed([int(d) for d in t.shape]))
        assert isinstance(stack, LazyExperts) and tuple(stack.shape) == tuple(want.shape)
        assert stack.form == _form(expert_type, keep_4bit)
        for e in range(len(stack)):
            w = stack[e]
            assert isinstance(w, _CLASS[stack.form])
            assert torch.equal(_dense(w), want[e]), (name, e)
        assert torch.equal(stack.to(dtype=torch.bfloat16), want.to(torch.bfloat16))
        assert torch.equal(stack.dequantize(), want)
        whole = stack.stacked()  # in its own form, [E, out, in]
        assert isinstance(whole, _CLASS[stack.form]) and tuple(whole.shape) == tuple(want.shape)
        assert torch.equal(_dense(whole), want)


@pytest.mark.parametrize("expert_type", ["Q4_K", "Q4_0", "Q6_K", "MXFP4"])
def test_expert_stacks_pack_into_the_expert_modules_exactly(random_files, expert_type):
    """What the loader's int4 path hands the expert modules (engine/model/quant/experts.py): the lazy stack itself,
    packed an expert at a time (4-bit codes kept; wider types in int8, as the loader treats a GGUF's other
    matrices), or MXFP4 stacked as it is; each module's weights are the file's (int8: within its rounding)."""
    from engine.model.quant.experts import Int4Experts, Int8Experts, Mxfp4Experts, expert_stack

    _, state, _, _ = load_gguf(random_files[expert_type], keep_4bit=True)
    stack = state["layers.0.mlp.experts.gate_proj"]
    source = stack.stacked() if stack.form == "mxfp4" else stack
    mode = "int8" if stack.form == "float" else "int4"
    module = expert_stack(source, None, mode, torch.float32, num_experts=len(stack), in_features=stack.in_features)
    kind = {"mxfp4": Mxfp4Experts, "affine4bit": Int4Experts, "float": Int8Experts}[stack.form]
    assert isinstance(module, kind)
    for e in range(len(stack)):
        want = _dense(stack[e])
        tolerance = 0 if kind is not Int8Experts else float(want.abs().max()) / 127
        torch.testing.assert_close(module.dequantize_expert(e), want, rtol=0, atol=tolerance + 1e-7)


def _counted(count: int, rows: int, cols: int, seed: int, form: str, reads: list[int]) -> LazyExperts:
    gen = torch.Generator().manual_seed(seed)
    weights = torch.randn(count, rows, cols, generator=gen)
    codes = torch.randint(0, 16, (count, rows, cols), generator=gen, dtype=torch.uint8)  # as 4-bit blocks give
    exponents = torch.randint(110, 130, (count, rows, cols // 32), generator=gen, dtype=torch.uint8)

    def read(e: int):
        reads.append(e)
        if form == "affine4bit":
            return Affine4Bit(codes[e], weights[e, :, ::32].abs(), weights[e, :, 1::32])
        if form == "mxfp4":
            return Mxfp4Tensor(codes[e, :, ::2] | (codes[e, :, 1::2] << 4), exponents[e])
        return weights[e]

    return LazyExperts(count, rows, cols, read, form, name=f"stack{seed}")


@pytest.mark.parametrize("form", ["float", "affine4bit", "mxfp4"])
def test_concatenated_stacks_read_nothing_until_an_expert_is_asked_for(form):
    reads: list[int] = []
    gate, up = _counted(3, 8, 64, 0, form, reads), _counted(3, 8, 64, 1, form, reads)
    fused = LazyExperts.cat([gate, up], dim=1)
    assert reads == [] and tuple(fused.shape) == (3, 16, 64) and fused.form == form
    second = fused[1]
    assert reads == [1, 1] and isinstance(second, _CLASS[form])
    assert torch.equal(_dense(second), torch.cat([_dense(gate[1]), _dense(up[1])]))
    share = fused.narrow(1, 2)
    assert len(share) == 2 and torch.equal(share.to(dtype=torch.float32)[0], fused.dequantize()[1])
    assert torch.equal(_dense(fused.stacked()), fused.dequantize())


def test_mixed_stacks_concatenate_as_floats():
    reads: list[int] = []
    fused = LazyExperts.cat([_counted(2, 8, 64, 0, "affine4bit", reads), _counted(2, 8, 64, 1, "mxfp4", reads)])
    assert fused.form == "float" and isinstance(fused[0], torch.Tensor) and fused[0].shape == (16, 64)


@pytest.mark.parametrize("expert_type,other_type", [("Q4_K", "Q6_K"), ("Q5_K", "Q8_0"), ("Q6_K", "Q4_K"),
                                                    ("MXFP4", "F16")])
def test_k_quant_moe_gives_transformers_gguf_logits(tmp_path: Path, expert_type, other_type):
    """A random Qwen3-MoE with K-quant (or MXFP4) experts: the engine's logits equal those of transformers'
    own GGUF loader (which dequantizes with gguf-py) holding the same file."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = write_random_moe_gguf(tmp_path / "moe.gguf", expert_type=expert_type, other_type=other_type, seed=7)
    config = AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name)
    config.moe_intermediate_size = 256  # transformers' qwen3_moe GGUF mapping has no expert_feed_forward_length
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(
        load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"], strict=False)
    assert not missing and not unexpected
    ids = list(range(1, 40))
    with torch.no_grad():
        want = model.eval()(input_ids=torch.tensor([ids])).logits[0]
    got = load_runner(str(path), dtype=torch.float32, quant="none").predict_logits(ids)
    assert float(want.abs().max()) > 0.1  # the routed experts move the logits
    assert float((got - want).abs().max()) <= 1e-4 * max(1.0, float(want.abs().max()))
