"""Weight-only quantization, always checked against the float32 path (never against itself).

- the 4-bit GGUF repack (Q4_0, Q4_1, Q4_K) reproduces gguf's own dequantization;
- the int8 / int4 modules compute x @ w^T for the weights they hold, and are batch-invariant; their dense
  copies (for prefill) hold the same weights, and a token gets the same numbers whatever shares its batch;
- a model loaded with int4 from a 4-bit GGUF holds exactly the float32 path's weights in every matmul;
- the quality guard: on the real models, top-1 agreement with float32 and perplexity on tests/data stay within
  the bounds below, for the default format (int4) and int8.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q
from gguf.quants import quantize as gguf_quantize

from engine import load_runner
from engine.loader.build import resolve_quant
from engine.runtime.quality import TextScore, score_text
from engine.runtime.quality import agreement as quality_agreement
from engine.model.batch import StepRow
from engine.model.batch import DENSE_MIN_ROWS
from engine.model.layers import dense_matmul
from engine.model.quant import (GROUP_SIZE, Affine4Bit, Int4Linear, Int8Embedding, Int8Linear, quantize_4bit,
    quantize_int8, quantized_linear)
from engine.model.quant.dot import Int4DotLinear
from engine.registry import KNOWN_MODELS
from engine.weights.dequant import affine_4bit, dequantize
from engine.weights.gguf_format import GGUFFile
from tests.support.tiny_models import VARIANTS, prompt_ids, write_gguf

DATA = Path(__file__).resolve().parents[3] / "data"
INT4_LINEARS = (Int4Linear, Int4DotLinear)  # torch's kernel's layout, and the dot-product kernel's (bfloat16 + VNNI)

# Quality bounds (measured values: bench/RESULTS.md#issue-17-quality,
# bench/RESULTS.md#issue-5-engine-weight-formats; `python bench/quality.py`): the fraction of positions whose
# argmax equals float32's, and the perplexity relative to float32's on the same texts, through the packed kernels
# (what decode runs). Activations rounded to int8 (engine/model/quant/dot.py, as llama.cpp) cost a little agreement
# against torch's kernels.
QUALITY_BOUNDS = {  # (model, quant): (min top-1 agreement, max perplexity ratio)
    ("smollm2-135m", "int4"): (0.94, 1.03),
    ("smollm2-135m", "int8"): (0.92, 1.03),
    ("gemma3-270m", "int4"): (0.93, 1.03),
    ("gemma3-270m", "int8"): (0.92, 1.03),
}


def _weights(rows: int = 48, cols: int = 256, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1])
def test_affine_4bit_repack_equals_gguf_dequantization(qtype: Q) -> None:
    raw = gguf_quantize(_weights(), qtype)
    packed = affine_4bit(raw, int(qtype), (48, 256))
    assert packed.codes.dtype == torch.uint8 and int(packed.codes.max()) <= 15
    torch.testing.assert_close(packed.dequantize(), dequantize(raw, int(qtype), (48, 256)), rtol=1e-6, atol=1e-7)


def test_affine_4bit_repack_of_real_q4_k_tensors() -> None:
    gguf = GGUFFile(KNOWN_MODELS["gemma3-270m"].path())
    entries = [e for e in gguf.tensors.values() if e.ggml_type == Q.Q4_K][:3]
    assert entries, "gemma3-270m Q4_K_M ships Q4_K matrices"
    for e in entries:
        raw = gguf.raw(e)
        assert torch.equal(affine_4bit(raw, e.ggml_type, e.shape).dequantize(),
                           dequantize(raw, e.ggml_type, e.shape, e.name)), e.name


def test_affine_4bit_is_none_for_other_types() -> None:
    raw = gguf_quantize(_weights(), Q.Q8_0)
    assert affine_4bit(raw, int(Q.Q8_0), (48, 256)) is None


def test_int8_quantization_in_row_chunks_equals_the_whole_matrix_at_once() -> None:
    w = torch.randn(1000, 64, generator=torch.Generator().manual_seed(3)) * torch.linspace(0.01, 10, 1000)[:, None]
    scale = w.abs().amax(dim=1) / 127
    codes, got_scale = quantize_int8(w, rows_per_chunk=96)  # chunks that do not divide the rows
    assert torch.equal(got_scale, scale)
    assert torch.equal(codes, torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))


def test_round_to_nearest_errors_are_within_half_a_step() -> None:
    w = torch.from_numpy(_weights(64, 128)) * 0.05
    four = quantize_4bit(w)
    step = four.scale.repeat_interleave(GROUP_SIZE, dim=1)
    assert float(((four.dequantize() - w).abs() - step / 2).max()) <= 1e-6
    codes, scale = quantize_int8(w)
    assert float(((codes.float() * scale[:, None] - w).abs() - scale[:, None] / 2).max()) <= 1e-6


@pytest.mark.parametrize("out_features,in_features,bias", [(40, 64, True), (48, 96, False), (576, 576, False)])
def test_int4_linear_computes_the_held_weights(out_features: int, in_features: int, bias: bool) -> None:
    torch.manual_seed(0)
    w = quantize_4bit(torch.randn(out_features, in_features) * 0.1)
    b = torch.randn(out_features) if bias else None
    x = torch.randn(5, in_features)
    want = x @ w.dequantize().t() + (b if bias else 0)
    # float32 activations: the kernel's reference path, exact up to summation order
    torch.testing.assert_close(Int4Linear(w, b, torch.float32)(x), want, rtol=1e-4, atol=1e-4)
    got = Int4Linear(w, b, torch.bfloat16)(x.bfloat16()).float()
    assert float((got - want).norm() / want.norm()) < 1e-2  # bfloat16 activations and scales


def test_int8_linear_computes_the_held_weights() -> None:
    torch.manual_seed(0)
    codes, scale = quantize_int8(torch.randn(48, 96))
    b = torch.randn(48)
    x = torch.randn(3, 96)
    want = x @ (codes.float() * scale[:, None]).t() + b
    torch.testing.assert_close(Int8Linear(codes, scale, b, torch.float32)(x), want, rtol=1e-4, atol=1e-4)
    got = Int8Linear(codes, scale, b, torch.bfloat16)(x.bfloat16()).float()
    assert float((got - want).norm() / want.norm()) < 1e-2


def test_int8_embedding_looks_up_the_quantized_rows() -> None:
    torch.manual_seed(0)
    codes, scale = quantize_int8(torch.randn(100, 64))
    ids = torch.tensor([3, 0, 99, 3])
    got = Int8Embedding(codes, scale, torch.float32)(ids)
    torch.testing.assert_close(got, (codes.float() * scale[:, None])[ids])


def test_quantized_matmuls_are_batch_invariant() -> None:
    """A row's output does not depend on the other rows of the batch (what batched serving relies on)."""
    torch.manual_seed(0)
    w = torch.randn(1536, 576) * 0.05
    x = torch.randn(17, 576).bfloat16()
    for module in (quantized_linear(w, None, "int4", torch.bfloat16), quantized_linear(w, None, "int8", torch.bfloat16)):
        full = module(x)
        for rows in (1, 3, 8, 16):
            assert torch.equal(module(x[:rows]), full[:rows]), (type(module).__name__, rows)


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_dense_copies_hold_the_packed_weights(mode: str) -> None:
    """The bfloat16 copy used for prefill is the packed weights dequantized (the kernel's rounded scales)."""
    torch.manual_seed(0)
    w = torch.randn(200, 576) * 0.05
    module = quantized_linear(w, None, mode, torch.bfloat16, keep_dense=True)
    assert module.dense.dtype == torch.bfloat16 and module.dense.shape == w.shape
    quantized = quantize_4bit(w).dequantize() if mode == "int4" else \
        (lambda c, s: c.float() * s[:, None])(*quantize_int8(w))
    assert float((module.dense.float() - quantized).abs().max()) <= 0.01 * float(quantized.abs().max())
    x = torch.randn(64, 576).bfloat16()
    packed, dense = module.packed_matmul(x).float(), torch.nn.functional.linear(x, module.dense).float()
    assert float((packed - dense).norm() / packed.norm()) < 1e-2


def test_packed_rows_send_decode_rows_to_the_kernel_and_prefill_rows_to_the_dense_copy() -> None:
    """Inside a batch each row's numbers are those of its own path alone, whatever else is in the call."""
    torch.manual_seed(0)
    module = quantized_linear(torch.randn(960, 576) * 0.05, None, "int4", torch.bfloat16, keep_dense=True)
    x = torch.randn(40, 576).bfloat16()
    alone_decode = torch.cat([module.packed_matmul(x[i:i + 1]) for i in range(3)])
    alone_prefill = dense_matmul(x[3:], module.dense)
    mixed = module(x, 3)
    assert torch.equal(mixed[:3], alone_decode) and torch.equal(mixed[3:], alone_prefill)
    # a prefill chunk shorter than DENSE_MIN_ROWS still takes the dense copy when the batch says so
    assert torch.equal(module(x[3:8], 0), dense_matmul(x[3:8], module.dense))
    # called without a batch's routing, every row takes the packed kernel
    assert torch.equal(module(x[:DENSE_MIN_ROWS]), module.packed_matmul(x[:DENSE_MIN_ROWS]))


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 40])
def test_dense_matmul_pads_rows_to_a_bucket_without_changing_them(rows: int) -> None:
    torch.manual_seed(0)
    w, x = torch.randn(96, 64), torch.randn(rows, 64)
    torch.testing.assert_close(dense_matmul(x, w), x @ w.t(), rtol=1e-5, atol=1e-5)  # float32: exact up to order
    assert dense_matmul(x, w).shape == (rows, 96)


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_decode_row_gets_the_same_logits_beside_a_prefill(tiny_zoo, variant) -> None:
    """Bit-identical: a sequence's decode step alone and in one forward pass with another prompt's prefill."""
    tiny = tiny_zoo.model(variant)
    logits = []
    for with_prefill in (False, True):
        runner = load_runner(str(tiny.safetensors_dir), quant="int4")
        a = runner.new_sequence(prompt_ids(tiny, 0, 20))
        runner.step([StepRow(a, 0, 20)])
        a.tokens.append(5)
        rows = [StepRow(a, 20, 21)]
        if with_prefill:
            b = runner.new_sequence(prompt_ids(tiny, 1, 40))
            rows.append(StepRow(b, 0, 40))
        logits.append(runner.step(rows)[0])
    assert torch.equal(logits[0], logits[1])


@pytest.mark.parametrize("variant", ["llama_tied", "gemma3"])
def test_a_short_chunk_gets_the_same_logits_beside_other_rows(tiny_zoo, variant) -> None:
    """Bit-identical: a short prefill chunk (packed kernels) alone and beside a long prefill (dense copies) and a
    decode row, in either order of the rows."""
    tiny = tiny_zoo.model(variant)
    logits = []
    for company in (False, True, "reversed"):
        runner = load_runner(str(tiny.safetensors_dir), quant="int4")
        a = runner.new_sequence(prompt_ids(tiny, 0, 12))
        rows = [StepRow(a, 0, 12)]
        if company:
            b = runner.new_sequence(prompt_ids(tiny, 1, 40))
            c = runner.new_sequence(prompt_ids(tiny, 1, 20))
            runner.step([StepRow(c, 0, 20)])
            c.tokens.append(7)
            rows += [StepRow(b, 0, 40), StepRow(c, 20, 21)]
        if company == "reversed":
            rows.reverse()
        out = runner.step(rows)
        logits.append(out[rows.index(next(r for r in rows if r.seq is a))])
    assert torch.equal(logits[0], logits[1]) and torch.equal(logits[0], logits[2])


def test_int4_falls_back_to_int8_when_groups_do_not_divide_the_input() -> None:
    assert isinstance(quantized_linear(torch.randn(32, 48), None, "int4", torch.bfloat16), Int8Linear)
    assert isinstance(quantized_linear(torch.randn(32, 64), None, "int4", torch.bfloat16), INT4_LINEARS)


@pytest.mark.parametrize("asked,dtype,source_quantized,expected", [
    (None, None, True, ("int4", torch.bfloat16)),          # a GGUF model on CPU: compressed by default
    (None, "float32", True, ("none", torch.float32)),      # float32 asked: the exact path
    (None, "bfloat16", True, ("int4", torch.bfloat16)),
    (None, None, False, ("none", torch.float32)),          # a float checkpoint stays as it is
    ("int8", None, False, ("int8", torch.bfloat16)),       # quantized on request
    ("none", "bfloat16", True, ("none", torch.bfloat16)),
])
def test_default_formats_per_source(asked, dtype, source_quantized, expected) -> None:
    assert resolve_quant(asked, dtype, torch.device("cpu"), source_quantized) == expected


def test_bad_quant_requests_are_refused() -> None:
    with pytest.raises(ValueError, match="unsupported quant"):
        resolve_quant("int3", None, torch.device("cpu"), True)
    with pytest.raises(ValueError, match="CPU and CUDA only"):
        resolve_quant("int4", None, torch.device("mps"), True)
    with pytest.raises(ValueError, match="computes in bfloat16"):
        resolve_quant("int4", "float32", torch.device("cuda"), True)
    assert resolve_quant(None, None, torch.device("cuda"), True) == ("none", torch.bfloat16)
    assert resolve_quant("int4", None, torch.device("cuda"), False) == ("int4", torch.bfloat16)  # a GPU draft


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("gguf_type", ["Q4_0", "Q4_1"])
def test_int4_load_of_a_4bit_gguf_holds_the_float32_paths_weights(tiny_zoo, tmp_path, variant, gguf_type) -> None:
    """Every matmul of the int4 model (llama q/k row permutation and q/k/v, gate/up fusion included) applies
    the weights the float32 path dequantizes; float32 activations make the kernel's result exact."""
    path = write_gguf(tiny_zoo.model(variant), gguf_type, tmp_path / f"{variant}-{gguf_type}.gguf")
    exact = load_runner(str(path), dtype="float32", quant="none").model
    packed = load_runner(str(path), dtype="float32", quant="int4").model
    dense = dict(exact.named_modules())
    checked = 0
    for name, module in packed.named_modules():
        if isinstance(module, Int4Linear):
            eye = torch.eye(module.in_features)
            want = dense[name].weight
            torch.testing.assert_close(module.packed_matmul(eye), want.t(), rtol=1e-6, atol=1e-6)
            if name != "lm_head":  # the layers' dense copies for prefill (the head never gets one)
                torch.testing.assert_close(module.dense, want, rtol=1e-6, atol=1e-6)
            checked += 1
    assert checked == 4 * len(exact.layers) + 1  # qkv, o, gate_up, down per layer, and the tied/untied head


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quantized_float_checkpoint_follows_the_float32_model(tiny_zoo, variant, quant) -> None:
    """Quantizing a safetensors checkpoint on request: logits stay near float32's (random tiny weights are the
    worst case for 4 bits; the real models' bounds are in test_quality_guard)."""
    tiny = tiny_zoo.model(variant)
    ids = prompt_ids(tiny, 0, 36)
    want = load_runner(str(tiny.safetensors_dir), dtype="float32").predict_logits(ids)
    runner = load_runner(str(tiny.safetensors_dir), quant=quant)
    assert runner.quant == quant and runner.dtype == torch.bfloat16
    got = runner.predict_logits(ids).float()
    rel = float((got - want).norm() / (want - want.mean(-1, keepdim=True)).norm())
    assert rel < {"int8": 0.08, "int4": 0.6}[quant], rel


def _quality_texts(runner) -> list[list[int]]:
    prompts = json.loads((DATA / "quality_prompts.json").read_text())
    return [runner.tokenizer.encode(p) for p in prompts] + [runner.tokenizer.encode((DATA / "quality_sample.txt").read_text())]


_REFERENCE_SCORES: dict[str, tuple[list[list[int]], list[TextScore]]] = {}  # per model: its texts, float32's scores


def _reference_scores(request, model: str) -> tuple[list[list[int]], list[TextScore]]:
    """The float32 runner's scores on the quality texts, computed once per model for both formats."""
    if model not in _REFERENCE_SCORES:
        reference = request.getfixturevalue("smollm" if model.startswith("smollm") else "gemma")  # float32
        texts = _quality_texts(reference)
        _REFERENCE_SCORES[model] = texts, [score_text(reference, ids) for ids in texts]
    return _REFERENCE_SCORES[model]


@pytest.mark.parametrize("model,quant", list(QUALITY_BOUNDS))
def test_quality_guard(request, model: str, quant: str) -> None:
    texts, want = _reference_scores(request, model)
    # Without dense copies every position runs the packed kernels a decode step runs (activations rounded to 8 bits
    # where engine/model/quant/dot.py serves), the lossier of the two paths; the dense copies are bfloat16 matmuls.
    candidate = load_runner(model, quant=quant, dense_prefill=False)
    assert candidate.dtype == torch.bfloat16
    agreement = quality_agreement([score_text(candidate, ids) for ids in texts], want)
    min_agreement, max_ratio = QUALITY_BOUNDS[(model, quant)]
    assert agreement.positions > 400
    assert agreement.top1_agreement >= min_agreement, agreement
    assert agreement.perplexity_ratio <= max_ratio, agreement
