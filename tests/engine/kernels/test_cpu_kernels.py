"""engine/kernels/cpu.py: the compiled CPU kernels against the torch path (the same contract as the Triton kernels:
tests/support/fused_kernel_cases.py `check`), the paged decode kernel against the float64 reference, their refusals, the
scripted calls, and the fallback ops when the library is turned off."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.kernels import cpu as cpu_kernels, fused as fused_kernels
from engine.kernels.paged_attention_torch import reference_decode, reference_prefill
from tests.support.fused_kernel_cases import FP16, VARIANTS, Case, build, check, copied, model_cases
from tests.support.paged_attention_cases import DECODE as DECODE_CASES
from tests.support.paged_attention_cases import OUT_FILL, TOLERANCE, Spec, claimed
from tests.support.paged_attention_cases import PREFILL as PREFILL_CASES
from tests.support.paged_attention_cases import build as build_paged

ROOT = Path(__file__).resolve().parents[3]
BF16 = torch.bfloat16
OPTIONS = ("out", "segments", "max_query_len")  # the Triton kernels' launch options some shared problems carry

pytestmark = pytest.mark.skipif(not cpu_kernels.available(),
                                reason=f"the CPU kernels did not build here: {cpu_kernels.why_not()}")

# Every model's calls at the row counts of a decode step (1, 3, 8) and of a prefill chunk (64, 300: split over
# threads), and the variants (CPU serves float32 and bfloat16, not float16).
CASES = [c for c in model_cases((1, 3, 8, 64)) + model_cases((300,), models=("smollm2",)) + VARIANTS
         if c.dtype != FP16]
# The shared problems CPU tensors can take (no float16 there), and longer ones, which the kernel splits over threads.
DECODE = [s for s in DECODE_CASES if s.dtype != FP16] + [
    Spec("bf16-smollm2-long", lens=(1500, 3, 700), heads=9, kv_heads=3, dtype=BF16),
    Spec("bf16-one-row", lens=(1,), heads=9, kv_heads=3, dtype=BF16),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_kernel_matches_the_torch_path(case):
    args = build(case)
    mine = copied(args)
    check(case, args, getattr(fused_kernels, case.call)(**mine), mine)


@pytest.mark.parametrize("spec", DECODE, ids=[s.name for s in DECODE])
def test_paged_decode_matches_the_reference(spec):
    args = build_paged(spec, seed=sum(map(ord, spec.name)))
    got = torch.ops.emberserve.paged_decode_attention(args["q"], args["keys"], args["values"], args["block_tables"],
                                                      args["seq_lens"], args["block_size"], args["scale"],
                                                      args["window"], args.get("sinks"))
    want = reference_decode(**{k: v for k, v in args.items() if k not in OPTIONS})
    assert got.dtype == spec.dtype and got.shape == args["q"].shape
    err = float((got.double() - want).abs().max())
    assert err <= TOLERANCE[spec.dtype], f"{spec.name}: max abs error {err:.2e}"
    padding = args["seq_lens"] == 0
    assert torch.equal(got[padding], torch.zeros_like(got[padding]))


PREFILL = [s for s in PREFILL_CASES if s.dtype != FP16] + [
    Spec("bf16-smollm2-question-after-a-long-prefix", lens=(2060,), query_lens=(12,), heads=9, kv_heads=3,
         dtype=BF16),
]


@pytest.mark.parametrize("spec", PREFILL, ids=[s.name for s in PREFILL])
def test_paged_prefill_matches_the_reference(spec):
    args = build_paged(spec, seed=sum(map(ord, spec.name)))
    out = args.get("out", torch.full_like(args["q"], OUT_FILL))
    got = torch.ops.emberserve.paged_prefill_attention(
        args["q"], args["keys"], args["values"], args["block_tables"], args["seq_lens"], args["query_lens"],
        args["query_starts"], args["block_size"], args["scale"], args["window"], out, args.get("sinks"))
    assert got.data_ptr() == out.data_ptr()
    want = reference_prefill(**{k: v for k, v in args.items() if k not in OPTIONS})
    mine = claimed(spec, got.shape[0])
    assert torch.equal(got[~mine], torch.full_like(got[~mine], OUT_FILL))  # tokens no row claims are left alone
    err = float((got[mine].double() - want[mine]).abs().max())
    assert err <= TOLERANCE[spec.dtype], f"{spec.name}: max abs error {err:.2e}"


def _decode_args(**change):
    args = build_paged(DECODE[0], seed=1)
    args = {k: args[k] for k in ("q", "keys", "values", "block_tables", "seq_lens", "block_size", "scale", "window")}
    args.update(change)
    return list(args.values())


@pytest.mark.parametrize("change, message", [
    ({"seq_lens": torch.tensor([37, 0, 1000, 5], dtype=torch.int32)}, "more keys than its block table"),
    ({"block_tables": torch.full((4, 7), 10_000, dtype=torch.int32)}, "not in the pool"),
    ({"q": torch.zeros(4, 7, 64)}, "multiple of the cache's KV heads"),
    ({"q": torch.zeros(4, 8, 64, dtype=BF16)}, "share a dtype"),
    ({"block_size": 40}, "whole blocks"),
])
def test_paged_decode_refuses_what_does_not_fit(change, message):
    with pytest.raises(RuntimeError, match=message):
        torch.ops.emberserve.paged_decode_attention(*_decode_args(**change))


def test_rope_refuses_a_slot_outside_the_cache():
    args = build(Case("rope_and_write_kv", "smollm2", 2))
    args["slots"] = torch.tensor([0, 10_000])
    with pytest.raises(RuntimeError, match="not in the cache"):
        fused_kernels.rope_and_write_kv(**args)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("call", ["rms_norm", "add_rms_norm", "norm_add_rms_norm", "rope_and_write_kv",
                                  "gated_activation"])
def test_scripted_calls_take_the_kernels(call):
    """Scripted (as the CPU decoder stack is) the public calls give what they give eagerly: the kernels' results."""
    case = Case(call, "gemma3-1b" if call in ("norm_add_rms_norm", "rope_and_write_kv") else "llama-1b", 3)
    args = build(case)
    eager = copied(args)
    want = getattr(fused_kernels, call)(**eager)
    scripted = copied(args)
    got = torch.jit.script(getattr(fused_kernels, call))(**scripted)
    for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert torch.equal(a, b)
    assert all(torch.equal(scripted[k], eager[k]) for k in eager if isinstance(eager[k], torch.Tensor))


_FALLBACK = """
import torch
from engine.kernels import cpu as cpu_kernels, fused as fused_kernels, fused_torch as fused_kernels_torch
assert not cpu_kernels.available() and not fused_kernels.CPU_KERNELS
x, r, w = torch.randn(3, 64), torch.randn(3, 64), torch.rand(64) + 0.5
got = torch.ops.emberserve.add_rms_norm(x, r, w, 1e-6)
want = fused_kernels_torch.add_rms_norm(x, r, w, 1e-6)
assert all(torch.equal(a, b) for a, b in zip(got, want))
print("ok")
"""


def test_without_the_library_the_ops_run_the_torch_path():
    env = {**os.environ, "EMBERSERVE_CPU_KERNELS": "0"}
    done = subprocess.run([sys.executable, "-c", _FALLBACK], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]



@pytest.mark.parametrize("queries,window,d,dtype,sinks", [
    (5, 0, 64, BF16, False), (17, 0, 64, BF16, False), (40, 0, 128, BF16, False), (23, 100, 64, BF16, False),
    (9, 0, 64, torch.float32, False), (17, 0, 64, BF16, True), (23, 100, 64, BF16, True)])
def test_chunk_queries_equal_decode_rows_bit_for_bit(queries, window, d, dtype, sinks):
    """A chunk's queries (a speculative verification row: the drafts and the last token) give each query exactly
    what the decode kernel gives it as a row of its own, or greedy outputs would change with speculation."""
    torch.manual_seed(queries)
    heads, kv_heads, bs, length = 9, 3, 16, 400
    blocks = -(-length // bs)
    keys = torch.randn(kv_heads, (blocks + 3) * bs, d, dtype=dtype)
    values = torch.randn_like(keys)
    table = torch.randperm(blocks + 3)[:blocks].to(torch.int32)[None]
    q = torch.randn(queries, heads, d, dtype=dtype)
    sink_logits = torch.randn(heads) + 1 if sinks else None
    out = torch.empty_like(q)
    chunk = torch.ops.emberserve.paged_prefill_attention(
        q, keys, values, table, torch.tensor([length], dtype=torch.int32), torch.tensor([queries], dtype=torch.int32),
        torch.tensor([0], dtype=torch.int32), bs, d ** -0.5, window, out, sink_logits)
    # each query alone: a decode row at its own position, seeing the keys up to it
    lens = torch.tensor([length - queries + i + 1 for i in range(queries)], dtype=torch.int32)
    decoded = torch.ops.emberserve.paged_decode_attention(q, keys, values, table.expand(queries, -1).contiguous(),
                                                          lens, bs, d ** -0.5, window, sink_logits)
    assert torch.equal(chunk, decoded)
