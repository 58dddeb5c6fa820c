"""Random problems for engine/kernels/fused.py at the shapes of the models we serve, shared by
tests/engine/kernels/test_fused_kernels.py (Triton's interpreter) and tests/gpu/test_fused_kernels_cuda.py (CUDA).

A problem is the keyword arguments of one public call; the expected result is `engine.kernels.fused_torch` (the
ops the decoder blocks run today) on a copy of it. Cache slots no token writes hold POISON, so a stray write shows.
What must match bit for bit (see `check`): residual sums, cached values, and rope without q/k norms in 16-bit
dtypes (every product there is exact in float32 and every rounding point is torch's); the rest within an ulp of
the dtype, the difference a reduction order or a libm makes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.kernels import fused_torch as fused_kernels_torch
from engine.model.layers import rope_cos_sin

POISON = 1000.0
EPS = 1e-6
FP16, FP32 = torch.float16, torch.float32
# |kernel - torch| <= RTOL * |torch| + ATOL: one ulp of the dtype (2^-7 of a bfloat16 at most), and a floor for the
# values near zero: where tanh-GELU saturates, torch's 1 + tanh(y) cancels to a few float32 ulps of 1.
RTOL = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10, torch.float32: 2e-6}
ATOL = {torch.bfloat16: 1e-4, torch.float16: 1e-5, torch.float32: 1e-5}
MIN_SAME = 0.9


@dataclass(frozen=True)
class Shape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    qk_norm: bool
    gelu: bool


MODELS = {
    "llama-1b": Shape(2048, 32, 8, 64, 8192, qk_norm=False, gelu=False),
    "qwen3-0.6b": Shape(1024, 16, 8, 128, 3072, qk_norm=True, gelu=False),
    "gemma3-1b": Shape(1152, 4, 1, 256, 6912, qk_norm=True, gelu=True),
    "smollm2": Shape(576, 9, 3, 64, 1536, qk_norm=False, gelu=False),
}
CALLS = ("rms_norm", "add_rms_norm", "norm_add_rms_norm", "rope_and_write_kv", "gated_activation")


@dataclass(frozen=True)
class Case:
    """One call: `variant` "" (the usual), "no-residual" (add_rms_norm of a first layer), "int32-slots",
    "no-qk-norm" (rope of a qk-norm model without them), "k-out" (rope also returning k), "batched" (norm input
    [2, rows, hidden])."""

    call: str
    model: str
    rows: int
    dtype: torch.dtype = torch.bfloat16
    variant: str = ""
    hidden: int | None = None  # overrides the model's (the widest norm)
    seed: int = 0              # another draw of the same problem

    @property
    def name(self) -> str:
        dt = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[self.dtype]
        extra = f"-{self.variant}" if self.variant else ""
        wide = f"-h{self.hidden}" if self.hidden else ""
        return f"{self.call}-{self.model}{wide}-n{self.rows}-{dt}{extra}"

    @property
    def qk_norm(self) -> bool:
        return MODELS[self.model].qk_norm and self.variant != "no-qk-norm"


def model_cases(rows: tuple[int, ...], models: tuple[str, ...] = tuple(MODELS)) -> list[Case]:
    """Each model's calls (the norm of its blocks, its rope, its activation) at each row count."""
    out = []
    for model in models:
        gemma = MODELS[model].gelu
        for n in rows:
            out += [Case("norm_add_rms_norm" if gemma else "add_rms_norm", model, n),
                    Case("rope_and_write_kv", model, n), Case("gated_activation", model, n)]
    return out


# The calls' other forms: first layers, the widest norm, other dtypes, batched rows, int32 slots, no q/k norms.
VARIANTS = [
    Case("rms_norm", "llama-1b", 3),
    Case("add_rms_norm", "llama-1b", 2, variant="no-residual"),
    Case("add_rms_norm", "llama-1b", 2, hidden=8192),
    Case("add_rms_norm", "qwen3-0.6b", 3, dtype=FP32),
    Case("add_rms_norm", "smollm2", 3, dtype=FP16, variant="batched"),
    Case("norm_add_rms_norm", "gemma3-1b", 2, variant="batched"),
    Case("rope_and_write_kv", "qwen3-0.6b", 3, variant="int32-slots"),
    Case("rope_and_write_kv", "gemma3-1b", 2, variant="no-qk-norm"),
    Case("rope_and_write_kv", "llama-1b", 3, dtype=FP16),
    Case("rope_and_write_kv", "llama-1b", 3, variant="k-out"),
    Case("rope_and_write_kv", "gemma3-1b", 2, variant="k-out"),
    Case("rope_and_write_kv", "qwen3-0.6b", 2, dtype=FP32),
    Case("gated_activation", "gemma3-1b", 2, dtype=FP32),
    Case("gated_activation", "llama-1b", 2, dtype=FP16),
]


def _randn(gen: torch.Generator, *shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    return torch.randn(shape, generator=gen) * scale + shift


def build(case: Case, device: str | torch.device = "cpu") -> dict[str, Any]:
    """The keyword arguments of `case`'s call, the same for the same case on every device."""
    gen = torch.Generator().manual_seed(sum(map(ord, case.name)) + 7919 * case.seed)
    s, n, dt = MODELS[case.model], case.rows, case.dtype
    hidden = case.hidden or s.hidden
    lead = (2, n) if case.variant == "batched" else (n,)
    if case.call == "gated_activation":
        args: dict[str, Any] = dict(gate_up=_randn(gen, n, 2 * s.ffn, scale=2.0), gelu=s.gelu)
    elif case.call == "rope_and_write_kv":
        # q, k and v as views of one projection output, on the device already (moving a view would copy it)
        qkv = _randn(gen, n, s.heads + 2 * s.kv_heads, s.head_dim, scale=2.0).to(device, dt)
        positions = torch.randint(0, 8192, (n,), generator=gen)
        inv_freq = 1.0 / 500000.0 ** (torch.arange(0, s.head_dim, 2).float() / s.head_dim)
        cos, sin = rope_cos_sin(inv_freq, positions, dt)
        slots = 2 * n + 16
        args = dict(qk=qkv[:, :s.heads + s.kv_heads], v=qkv[:, s.heads + s.kv_heads:], cos=cos, sin=sin,
                    keys=torch.full((s.kv_heads, slots, s.head_dim), POISON),
                    values=torch.full((s.kv_heads, slots, s.head_dim), -POISON),
                    slots=torch.randperm(slots, generator=gen)[:n].to(
                        torch.int32 if case.variant == "int32-slots" else torch.int64))
        if case.variant == "k-out":
            args["k_out"] = torch.full((n, s.kv_heads, s.head_dim), POISON)
        if case.qk_norm:  # gemma's 1 + w folded in, as the loader does
            args.update(q_norm_weight=_randn(gen, s.head_dim, scale=0.3, shift=1.0),
                        k_norm_weight=_randn(gen, s.head_dim, scale=0.3, shift=1.0), eps=EPS)
    else:
        # rows of magnitudes 10^-3.5 .. 10: the small ones' mean square is near eps, so eps shows in the result
        def rows() -> torch.Tensor:
            magnitude = 10.0 ** (torch.rand((*lead, 1), generator=gen) * 4.5 - 3.5)
            return _randn(gen, *lead, hidden) * magnitude

        args = dict(weight=_randn(gen, hidden, scale=0.3, shift=1.0), eps=EPS)
        if case.call == "rms_norm":
            args["x"] = rows()
        elif case.call == "add_rms_norm":
            args.update(x=rows(), residual=None if case.variant == "no-residual" else rows())
        else:
            args.update(branch=rows(), residual=rows(), branch_weight=_randn(gen, hidden, scale=0.3, shift=1.0))
    # norm weights stay float32, as the loader keeps them
    return {k: (v.to(device, dt) if v.is_floating_point() and not k.endswith("weight") else v.to(device))
            if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def copied(args: dict[str, Any]) -> dict[str, Any]:
    """The arguments with every tensor copied (the rope call writes into its caches)."""
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def expected(case: Case, args: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """(output, arguments after the call) of the torch path on a copy of `args`."""
    mine = copied(args)
    return getattr(fused_kernels_torch, case.call)(**mine), mine


def _close(name: str, got: torch.Tensor, want: torch.Tensor, exact: bool, per_vector: bool = False) -> None:
    """Bit for bit, or within an ulp of each element (`per_vector`: of the largest in its last dimension)."""
    assert got.shape == want.shape and got.dtype == want.dtype, (
        f"{name}: {tuple(got.shape)} {got.dtype}, want {tuple(want.shape)} {want.dtype}")
    got, want = got.cpu(), want.cpu()
    if exact:
        bad = int((got != want).sum())
        assert bad == 0, f"{name}: {bad} of {want.numel()} elements differ from torch's (bit-exact expected)"
        return
    g, w = got.double(), want.double()
    assert torch.isfinite(g).all(), f"{name}: not finite"
    slack = RTOL[want.dtype] * w.abs() + ATOL[want.dtype]
    if per_vector:
        slack = slack + RTOL[want.dtype] * w.abs().amax(-1, keepdim=True)
    excess = float(((g - w).abs() - slack).max())
    worst = float((g - w).abs().max())
    assert excess <= 0, f"{name}: max abs difference {worst:.3g} is more than an ulp of {want.dtype}"
    if want.dtype != torch.float32:
        # and most elements bit for bit: a reduction order or a libm flips a rounding here and there, while a
        # rounding point other than torch's (an intermediate kept in float32) differs in a large share
        same = float((got == want).float().mean())
        assert same >= MIN_SAME, f"{name}: only {same:.1%} of the elements equal torch's"


def check(case: Case, args: dict[str, Any], result: Any, after: dict[str, Any]) -> None:
    """The kernel's `result` (and the arguments `after` its call) against the torch path's."""
    want, want_after = expected(case, args)
    sixteen = case.dtype != torch.float32
    if case.call == "rope_and_write_kv":
        # an ulp flipped in a normed head (its sum of squares in another order) moves x cos + partner sin by an ulp
        # of the head's values, which may be far more than one of a result that cancels
        exact = sixteen and not case.qk_norm
        _close("q", result, want, exact, per_vector=case.qk_norm)
        _close("keys", after["keys"], want_after["keys"], exact, per_vector=case.qk_norm)
        _close("values", after["values"], want_after["values"], True)
        if "k_out" in args:
            _close("k_out", after["k_out"], want_after["k_out"], exact, per_vector=case.qk_norm)
    elif case.call in ("add_rms_norm", "norm_add_rms_norm"):
        _close("normed", result[0], want[0], False)
        # the plain sum is exact; gemma's adds a normed (rounded) branch, an ulp of which may differ
        _close("residual", result[1], want[1], case.call == "add_rms_norm")
    else:
        _close("out", result, want, False)
