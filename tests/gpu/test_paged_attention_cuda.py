"""engine/kernels/paged_attention.py's Triton kernels compiled for a real GPU, at the shapes of the models we serve, against
the float64 reference; plus CUDA-graph capture, int64 cache offsets and a timing print (not an assertion).

Skipped without CUDA or Triton. `pytest -s tests/gpu/test_paged_attention_cuda.py` shows the timings.
"""
from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from engine.kernels import paged_attention
from engine.cache.kv_cache import gather_blocks
from engine.model.layers import decode_attention
from engine.kernels.paged_attention_torch import reference_decode, reference_prefill
from tests.support.paged_attention_cases import TOLERANCE, Spec, build, claimed

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]
BF16, FP16 = torch.bfloat16, torch.float16
# (heads, kv heads, head_dim, window): Llama-3.2-1B, Qwen3-0.6B, Gemma-3-1B's sliding layers
MODELS = {"llama-1b": (32, 8, 64, 0), "qwen3-0.6b": (16, 8, 128, 0), "gemma3-1b": (4, 1, 256, 512)}


def _lens(count: int, longest: int, seed: int, padding: int = 0) -> tuple[int, ...]:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, longest + 1, (count,), generator=gen).tolist()
    return tuple(lens[:count - padding] + [0] * padding)


def _spec(name: str, model: str, lens: tuple[int, ...], dtype: torch.dtype, **kw) -> Spec:
    heads, kv_heads, head_dim, window = MODELS[model]
    return Spec(f"{model}-{name}", lens=lens, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                **{"window": window, **kw})


DECODE = [
    _spec("b1", "llama-1b", (1500,), BF16),
    _spec("b8-padding", "llama-1b", _lens(8, 2048, 1, padding=2), BF16, shared_blocks=4),
    _spec("b64", "llama-1b", _lens(64, 1024, 2), BF16, options={"segments": 1}),
    _spec("b1", "qwen3-0.6b", (700,), BF16),
    _spec("b32-fp16", "qwen3-0.6b", _lens(32, 1024, 3, padding=1), FP16),
    _spec("b4-fp32", "qwen3-0.6b", _lens(4, 600, 4), torch.float32, block_size=32),
    _spec("b1-window", "gemma3-1b", (1800,), BF16),
    _spec("b16-window", "gemma3-1b", _lens(16, 1500, 5, padding=3), BF16, block_size=8),
    _spec("b4-global", "gemma3-1b", _lens(4, 1500, 6), BF16, window=0),
]
PREFILL = [
    _spec("fresh512-chunk-single", "llama-1b", (512, 1000, 300), BF16, query_lens=(512, 256, 1)),
    _spec("chunks", "qwen3-0.6b", (2048, 90), BF16, query_lens=(512, 90), block_size=32),
    _spec("fp32", "qwen3-0.6b", (400,), torch.float32, query_lens=(130,)),
    _spec("window", "gemma3-1b", (1400, 600), BF16, query_lens=(512, 600), gap=5),
    _spec("global-fp16", "gemma3-1b", (700,), FP16, query_lens=(700,), window=0),
]


def _reference(spec: Spec, args: dict) -> torch.Tensor:
    plain = {k: v for k, v in args.items() if k not in ("out", "segments", "max_query_len")}
    return reference_decode(**plain) if spec.decode else reference_prefill(**plain)


_PROBLEMS: dict[str, tuple[dict, torch.Tensor]] = {}


def _problem(spec: Spec) -> tuple[dict, torch.Tensor]:
    """The problem on the GPU and its reference output, built once for both backends' tests."""
    if spec.name not in _PROBLEMS:
        args = build(spec, seed=sum(map(ord, spec.name)), device="cuda")
        _PROBLEMS[spec.name] = args, _reference(spec, args)
    return _PROBLEMS[spec.name]


def _check(spec: Spec, args: dict, result: torch.Tensor, expected: torch.Tensor | None = None) -> None:
    expected = _reference(spec, args) if expected is None else expected
    result = result.double().cpu()
    if not spec.decode:
        mine = claimed(spec, result.shape[0])
        result, expected = result[mine], expected[mine]
    assert torch.isfinite(result).all()
    err = float((result - expected).abs().max())
    assert err <= TOLERANCE[spec.dtype], f"{spec.name}: max abs error {err:.2e} > {TOLERANCE[spec.dtype]:.0e}"


@pytest.mark.parametrize("spec", DECODE + PREFILL, ids=lambda s: ("decode-" if s.decode else "prefill-") + s.name)
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_matches_reference(spec, backend):
    args, expected = _problem(spec)
    fn = paged_attention.paged_decode_attention if spec.decode else paged_attention.paged_prefill_attention
    _check(spec, args, fn(**args, backend=backend), expected)


def test_decode_in_a_cuda_graph():
    """Captured once for a batch bucket, replayed with new lengths and tables in the same buffers."""
    spec = _spec("graph", "llama-1b", _lens(8, 1000, 7, padding=2), BF16, width=100)
    static = build(spec, seed=1, device="cuda")
    static["out"] = torch.empty_like(static["q"])
    paged_attention.paged_decode_attention(**static)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention.paged_decode_attention(**static)
    for seed in (2, 3):
        fresh = build(dataclasses.replace(spec, lens=_lens(8, 1400, seed, padding=seed - 1)), seed, "cuda")
        for name in ("q", "keys", "values", "block_tables", "seq_lens"):
            static[name].copy_(fresh[name])
        graph.replay()
        _check(spec, fresh, static["out"])


def test_offsets_past_int32():
    """A pool of more than 2**31 elements per layer (what a large GPU's KV budget gives), read at its far end."""
    kv_heads, head_dim, bs = 8, 128, 16
    slots = (2**31 // (kv_heads * head_dim) // bs + 64) * bs
    keys = torch.zeros((kv_heads, slots, head_dim), dtype=BF16, device="cuda")
    values = torch.zeros_like(keys)
    last = slots // bs - 1
    tables = torch.tensor([[last - i for i in range(40)], [3, last - 50, 7, last - 60] + [0] * 36],
                          dtype=torch.int32, device="cuda")
    lens = torch.tensor([640, 60], dtype=torch.int32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for r, n in enumerate(lens.tolist()):
        pos = torch.arange(n, device="cuda")
        s = tables[r, pos // bs].long() * bs + pos % bs
        keys[:, s] = torch.randn((kv_heads, n, head_dim), generator=gen, device="cuda").to(BF16)
        values[:, s] = torch.randn((kv_heads, n, head_dim), generator=gen, device="cuda").to(BF16)
    q = torch.randn((2, 16, head_dim), generator=gen, device="cuda").to(BF16)
    out = paged_attention.paged_decode_attention(q, keys, values, tables, lens, bs, head_dim ** -0.5)
    # the reference on the used blocks only: a copy of the whole pool to the CPU would be 9 GB
    used = sorted(set(tables.flatten().tolist()))
    remap = {b: i for i, b in enumerate(used)}
    small_tables = torch.tensor([[remap[b] for b in row] for row in tables.tolist()], dtype=torch.int32)
    pick = torch.tensor(used, device="cuda")
    small_k = gather_blocks(keys, pick, bs).cpu()
    small_v = gather_blocks(values, pick, bs).cpu()
    expected = reference_decode(q.cpu(), small_k, small_v, small_tables, lens.cpu(), bs, head_dim ** -0.5)
    assert float((out.double().cpu() - expected).abs().max()) <= TOLERANCE[BF16]
    del keys, values
    torch.cuda.empty_cache()


def _time_ms(fn, repeats: int = 50) -> float:
    """GPU time of one call of `fn`, replayed from a CUDA graph (as the engine will run it: no launch overhead)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def _random_pool(rows: int, length: int, heads: int, kv_heads: int, head_dim: int, queries: int) -> dict:
    """A timing problem made on the GPU: rows of `length` keys in shuffled blocks of 16, `queries` per row."""
    width = -(-length // 16)
    tables = torch.randperm(rows * width, device="cuda").view(rows, width).to(torch.int32)
    keys = torch.randn((kv_heads, rows * width * 16, head_dim), device="cuda", dtype=BF16)
    return dict(q=torch.randn((rows * queries, heads, head_dim), device="cuda", dtype=BF16), keys=keys,
                values=torch.randn_like(keys), block_tables=tables,
                seq_lens=torch.full((rows,), length, dtype=torch.int32, device="cuda"), block_size=16,
                scale=head_dim ** -0.5)


def test_timing_print(capsys):
    """Per-layer decode attention at 1024 keys, each replayed from a CUDA graph: the Triton kernel against today's
    gather + float32 bmm (engine/model/layers.py's decode_attention)."""
    lines = ["decode attention per layer, 1024 keys per row (bf16):",
             "| model | batch | triton us | GB/s of K+V | gather+bmm us |", "|---|---|---|---|---|"]
    for model in ("llama-1b", "qwen3-0.6b"):
        heads, kv_heads, head_dim, _ = MODELS[model]
        for batch in (1, 32, 256):
            args = _random_pool(batch, 1024, heads, kv_heads, head_dim, 1)
            args["out"] = torch.empty_like(args["q"])
            triton_ms = _time_ms(lambda: paged_attention.paged_decode_attention(**args))
            blocks = args["block_tables"].long()

            def gather_bmm() -> torch.Tensor:
                k = gather_blocks(args["keys"], blocks, 16)
                v = gather_blocks(args["values"], blocks, 16)
                return decode_attention(args["q"], k, v, None, kv_heads, args["scale"])

            old_ms = _time_ms(gather_bmm, repeats=10)
            kv_bytes = 2 * batch * 1024 * kv_heads * head_dim * 2
            lines.append(f"| {model} | {batch} | {1000 * triton_ms:.1f} | {kv_bytes / triton_ms / 1e6:.0f} | "
                         f"{1000 * old_ms:.1f} |")
    heads, kv_heads, head_dim, _ = MODELS["llama-1b"]
    args = _random_pool(1, 2048, heads, kv_heads, head_dim, 2048)
    lens = torch.tensor([2048], dtype=torch.int32, device="cuda")
    starts = torch.zeros(1, dtype=torch.int32, device="cuda")
    ms = _time_ms(lambda: paged_attention.paged_prefill_attention(**args, query_lens=lens, query_starts=starts),
                  repeats=10)
    flops = 4 * 2048 * 2048 / 2 * heads * head_dim
    lines.append(f"prefill llama-1b 2048 tokens from 0, one layer: {1000 * ms:.0f} us ({flops / ms / 1e9:.0f} "
                 f"TFLOP/s causal)")
    with capsys.disabled():
        print("\n" + "\n".join(lines))
