"""A gpt-oss checkpoint as OpenAI publishes it: experts in MXFP4 (`*_blocks` / `*_scales`, gate and up rows
interleaved), everything else in float. It loads with its experts kept 4-bit, and its logits equal transformers'
gpt-oss holding exactly the dequantized weights; /v1/models-style facts count the blocks as parameters."""
from __future__ import annotations

import copy
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine import load_runner
from engine.model.quant.experts import Mxfp4DotExperts, Mxfp4Experts
from engine.model.quant.mxfp4 import quantize_mxfp4
from engine.weights.summary import read_summary
from tests.support.tiny_models import assert_logits_close, hf_logits, prompt_ids


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tiny_zoo, tmp_path_factory) -> tuple[Path, torch.nn.Module, int]:
    """(the MXFP4 checkpoint's directory, the HF model with its dequantized weights, the float parameter count)."""
    tiny = tiny_zoo.model("gpt_oss")
    out = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    for f in tiny.safetensors_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    reference = copy.deepcopy(tiny.hf_model)
    tensors = {}
    state = reference.state_dict()
    with torch.no_grad():
        for name, tensor in state.items():
            if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
                rows = tensor.transpose(1, 2).contiguous()  # [E, out, in]: the published blocks' orientation
                q = quantize_mxfp4(rows)
                e, o, i = rows.shape
                tensors[f"{name}_blocks"] = q.blocks.reshape(e, o, i // 32, 16).contiguous()
                tensors[f"{name}_scales"] = q.scales.contiguous()
                reference.get_parameter(name).copy_(q.dequantize().transpose(1, 2))
            else:
                tensors[name] = tensor.contiguous()
    save_file(tensors, str(out / "model.safetensors"))
    return out, reference.eval(), sum(t.numel() for t in state.values())


def test_experts_stay_4_bit_and_logits_equal_the_dequantized_reference(tiny_zoo, mxfp4_checkpoint) -> None:
    path, reference, _ = mxfp4_checkpoint
    runner = load_runner(str(path), dtype=torch.float32)
    experts = runner.model.layers[0].mlp.experts
    assert isinstance(experts.gate_up, (Mxfp4Experts, Mxfp4DotExperts))
    assert isinstance(experts.down, (Mxfp4Experts, Mxfp4DotExperts))
    ids = prompt_ids(tiny_zoo.model("gpt_oss"), 0, 36)
    assert_logits_close(runner.predict_logits(ids), hf_logits(reference, ids), "gpt-oss MXFP4 checkpoint")


def test_summary_counts_mxfp4_blocks_as_parameters(mxfp4_checkpoint) -> None:
    path, _, parameters = mxfp4_checkpoint
    summary = read_summary(path)
    assert summary.family == "gpt_oss"
    assert summary.parameters == parameters
    assert (summary.experts, summary.experts_used) == (4, 2)
