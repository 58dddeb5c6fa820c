"""Quantized weights on CUDA (skipped without one; run on the GPU machine): the int4 (tinygemm) and int8 linears
against the dense weights they hold, every tiny family's int4 model against the CPU's int4 model and replayed from
graphs against eager, and a `--draft-model self-int4` server whose greedy answers equal the same server's without
speculation."""
from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from bench.synthetic_model import Shape, write_model_dir
from engine import load_runner
from engine.model.quant import Int4Linear, Int8Linear, kernel_dense_weights, quantize_4bit, quantized_linear
from engine.model.quant.cuda import Int4CudaLinear
from tests.support.server_process import start_server, stop_server
from tests.support.tiny_models import VARIANTS, build_tiny_model, prompt_ids

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def tinies(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("tiny-quant-cuda")
    return {v: build_tiny_model(v, root / v) for v in VARIANTS}


@pytest.mark.parametrize("out_features,in_features", [(3072, 2048), (100, 96), (49152, 256)])
@pytest.mark.parametrize("rows", [1, 5, 16, 33, 130])
def test_int4_linear_on_cuda_computes_with_its_dequantized_weights(out_features, in_features, rows) -> None:
    """tinygemm's product = x @ w^T for the dense weights of the same codes, scales and zeros (rows padded to 8
    and inputs tiled as the kernel needs), with a bias; and the same weights as the CPU's int4 layer."""
    torch.manual_seed(rows)
    w = quantize_4bit(torch.randn(out_features, in_features) * 0.05)
    bias = torch.randn(out_features)
    layer = quantized_linear(w, bias, "int4", torch.bfloat16, device=CUDA)
    assert isinstance(layer, Int4CudaLinear)
    dense = kernel_dense_weights(w.codes.to(CUDA), layer.scale_and_zero, out_features).float()
    x = torch.randn(rows, in_features, device=CUDA).to(torch.bfloat16)
    got = layer(x).float()
    want = x.float() @ dense.t() + bias.to(CUDA).to(torch.bfloat16).float()
    assert got.shape == (rows, out_features)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))
    cpu_dense = Int4Linear(w, None, torch.bfloat16, keep_dense=True).dense
    torch.testing.assert_close(cpu_dense.float(), dense.cpu(), rtol=0, atol=0)


def test_int8_linear_on_cuda_computes_with_its_dequantized_weights() -> None:
    torch.manual_seed(0)
    w = torch.randn(3072, 2048) * 0.05
    layer = quantized_linear(w, None, "int8", torch.bfloat16, device=CUDA)
    assert isinstance(layer, Int8Linear) and layer.weight.is_cuda
    x = torch.randn(7, 2048, device=CUDA).to(torch.bfloat16)
    want = x.float() @ (layer.weight.float() * layer.scale.float().unsqueeze(1)).t()
    torch.testing.assert_close(layer(x).float(), want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))


@pytest.mark.parametrize("variant", VARIANTS)
def test_int4_model_on_cuda_matches_the_cpu_int4_model_and_its_graphs_equal_eager(tinies, variant) -> None:
    tiny = tinies[variant]
    gpu = load_runner(str(tiny.safetensors_dir), device="cuda", quant="int4")
    cpu = load_runner(str(tiny.safetensors_dir), quant="int4", dtype="bfloat16")
    assert gpu.quant == "int4" and any(isinstance(m, Int4CudaLinear) for m in gpu.model.modules())
    ids = prompt_ids(tiny, 0, 36)
    got, want = gpu.predict_logits(ids).float().cpu(), cpu.predict_logits(ids).float()
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) < 0.05 * scale, (variant, float((got - want).abs().max()), scale)
    eager = gpu.generate(ids[:12], 20)
    gpu.capture_cuda_graphs(8)
    assert gpu.generate(ids[:12], 20) == eager


SMALL = Shape("llama", 256, 4, 4, 2, 64, 512, 49152, 10000.0)


def _greedy_answers(base_url: str, prompts: list[str]) -> list[str]:
    async def main() -> list[str]:
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
            async def one(prompt: str) -> str:
                r = await client.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 40,
                                                               "temperature": 0, "ignore_eos": True})
                r.raise_for_status()
                return r.json()["choices"][0]["text"]
            return await asyncio.gather(*(one(p) for p in prompts))
    return asyncio.run(main())


def test_a_self_int4_draft_on_cuda_keeps_greedy_answers(tmp_path) -> None:
    """Four concurrent greedy requests (each a lone decoding row at times, so drafts are made) answer the same with
    the target's int4 copy drafting as without; the drafts are counted in /health."""
    model = write_model_dir(SMALL, tmp_path / "model", device="cuda")
    prompts = [f"The {w} of the story is" for w in ("start", "middle", "end", "point")]
    answers = {}
    for name, flags in (("plain", []), ("draft", ["--draft-model", "self-int4", "--num-speculative-tokens", "3"])):
        srv = start_server(tmp_path, "--model", str(model.path), "--device", "cuda", "--served-model-name", "m",
                           "--kv-cache-memory", "1GiB", *flags)
        try:
            answers[name] = _greedy_answers(srv.base_url, prompts[:1]) + _greedy_answers(srv.base_url, prompts)
            health = httpx.get(f"{srv.base_url}/health").json()
        finally:
            stop_server(srv)
        assert "Traceback" not in srv.log(), srv.log()[-3000:]
        if name == "draft":
            assert health["spec_decode_num_drafts"] > 0, health
            assert 0 <= health["spec_decode_num_accepted_tokens"] <= health["spec_decode_num_draft_tokens"]
    assert answers["draft"] == answers["plain"]
