"""bench/synthetic_model.py's mixture-of-experts checkpoints: what transformers' own classes load without missing or
unexpected keys, and sizes that agree with the published models' (the benchmarks' rooflines divide by them)."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from bench.synthetic_model import (SHAPES, active_weight_bytes, estimated_weight_bytes, hf_config, shape_by_name,
                                   write_model_dir)
from engine.config import config_from_hf


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-gpt-oss", "tiny-gpt-oss-mxfp4", "tiny"])
def test_transformers_loads_every_tensor(tmp_path, name: str) -> None:
    shape = SHAPES[name]
    model_dir = write_model_dir(shape, tmp_path / name, "cpu", shard_bytes=100_000)  # several shards and an index
    assert model_dir.weight_bytes == estimated_weight_bytes(shape)
    model, info = AutoModelForCausalLM.from_pretrained(str(model_dir.path), dtype=torch.float32,
                                                       output_loading_info=True)
    assert not any(info.values()), info
    with torch.no_grad():
        logits = model(torch.tensor([[5, 6, 7, 8]])).logits
    assert logits.isfinite().all()
    assert 0.1 < float(logits.std()) < 10


def test_mxfp4_experts_spread_like_the_bfloat16_ones(tmp_path) -> None:
    """transformers dequantizes the MXFP4 blocks (the reference decoder of the format): each expert matrix's
    values spread about as the bfloat16 draw's, 1/sqrt(fan_in)."""
    model = AutoModelForCausalLM.from_pretrained(
        str(write_model_dir(SHAPES["tiny-gpt-oss-mxfp4"], tmp_path / "m", "cpu").path), dtype=torch.float32)
    experts = model.model.layers[0].mlp.experts
    hidden = SHAPES["tiny-gpt-oss-mxfp4"].hidden
    assert 0.5 < float(experts.gate_up_proj.std()) * hidden ** 0.5 < 2.0


@pytest.mark.parametrize("name, total_params, active_params, counts_embedding", [
    ("qwen3-30b-a3b", 30.5e9, 3.3e9, True),  # Qwen3-30B-A3B's model card: 30.5B total, 3.3B activated
    ("gpt-oss-20b", 20.9e9, 3.6e9, False),  # the gpt-oss model card: 20.9B total (21B), 3.6B active
])
def test_sizes_match_the_published_models(name: str, total_params: float, active_params: float,
                                          counts_embedding: bool) -> None:
    shape = SHAPES[name]
    assert estimated_weight_bytes(shape) / 2 == pytest.approx(total_params, rel=0.02)
    # active: what a token reads (one embedding row); Qwen's card counts the whole embedding table
    embedding_extra = shape.vocab * shape.hidden - shape.hidden if counts_embedding else 0
    assert (active_weight_bytes(shape) / 2 + embedding_extra) == pytest.approx(active_params, rel=0.03)


def test_the_published_mxfp4_checkpoint_size() -> None:
    assert estimated_weight_bytes(SHAPES["gpt-oss-20b-mxfp4"]) == pytest.approx(13.8e9, rel=0.02)  # its 3 files


def test_the_engine_reads_the_configs() -> None:
    cfg = config_from_hf(hf_config(SHAPES["qwen3-30b-a3b"]))
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.expert_intermediate, cfg.num_layers) == (128, 8, 768, 48)
    cfg = config_from_hf(hf_config(SHAPES["gpt-oss-20b"]))
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.attention_sinks, cfg.rope.scaling["rope_type"]) == \
        (32, 4, True, "yarn")
    assert cfg.layer_is_sliding[:4] == [True, False, True, False]
    assert shape_by_name("qwen3-30b-a3b@12").layers == 12
    dense = config_from_hf(hf_config(SHAPES["dense-active-qwen3moe-cpu"]))
    assert dense.moe is None and dense.intermediate_size == 2 * SHAPES["qwen3-moe-cpu"].expert_ffn
