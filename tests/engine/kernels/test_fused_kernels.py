"""engine/kernels/fused.py: the Triton kernels (run by Triton's CPU interpreter) against the torch path at the shapes
of the models we serve (tests/support/fused_kernel_cases.py); the torch path against the decoder blocks' own ops; the
public calls under TorchScript (the CPU stack is scripted).

TRITON_INTERPRET=1 has to be set before the kernels are defined and must not leak into other tests, so the
interpreted calls run in one subprocess (tests/support/interpreted.py): the problems are built here, the
subprocess only calls the kernels on them, and everything is compared here.
"""
from __future__ import annotations

import pytest
import torch

from engine.kernels import fused as fused_kernels, fused_torch as fused_kernels_torch
from engine.model import layers
from tests.support.fused_kernel_cases import EPS, VARIANTS, Case, build, check, copied, expected, model_cases
from tests.support.interpreted import ROUND_TO_NEAREST_EVEN, run_interpreted

# Every model's calls at 1, 3 and 8 rows; 128 rows at the smallest shapes (the interpreter runs programs one by
# one: the GPU test takes every model at 128); then the variants.
INTERPRETED = [
    *model_cases((1, 3, 8)),
    *model_cases((128,), models=("smollm2",)),
    *VARIANTS,
]


def _bad_calls() -> list[tuple[str, str, dict]]:
    """(id, call, arguments) the Triton path refuses with a ValueError before launching anything."""
    rope = build(Case("rope_and_write_kv", "llama-1b", 2))
    norm = build(Case("add_rms_norm", "llama-1b", 2))
    return [
        ("v-heads", "rope_and_write_kv", {**rope, "v": rope["v"][:, :4]}),
        ("float-slots", "rope_and_write_kv", {**rope, "slots": rope["slots"].float()}),
        ("cos-shape", "rope_and_write_kv", {**rope, "cos": rope["cos"][:1]}),
        ("k-out-shape", "rope_and_write_kv", {**rope, "k_out": torch.zeros(2, 8, 32, dtype=torch.bfloat16)}),
        ("cache-dtype", "rope_and_write_kv", {**rope, "keys": rope["keys"].float(), "values": rope["values"].float()}),
        ("q-norm-alone", "rope_and_write_kv", {**rope, "q_norm_weight": torch.ones(64)}),
        ("residual-shape", "add_rms_norm", {**norm, "residual": norm["residual"][:1]}),
        ("weight-size", "add_rms_norm", {**norm, "weight": norm["weight"][:100]}),
        ("odd-gate-up", "gated_activation", {"gate_up": torch.zeros(2, 7), "gelu": False}),
    ]


# Calls the kernels on the saved problems; writes [(output, arguments after the call)] and the refusals' messages.
_INTERPRETED_CALLS = ROUND_TO_NEAREST_EVEN + """

from engine.kernels import fused as fused_kernels
calls, bad = torch.load(sys.argv[1])
results = [(getattr(fused_kernels, name)(**args), args) for name, args in calls]
refusals = []
for name, args in bad:
    try:
        getattr(fused_kernels, name)(**args)
        refusals.append(None)
    except ValueError as e:
        refusals.append(str(e))
torch.save((results, refusals), sys.argv[2])
"""


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> tuple[list, list]:
    """([(output, arguments after the call)] of every case, [the message of each refused call or None])."""
    calls = [(case.call, build(case)) for case in INTERPRETED]
    return run_interpreted(_INTERPRETED_CALLS, (calls, [(name, args) for _, name, args in _bad_calls()]),
                           tmp_path_factory.mktemp("fused_kernels"))


@pytest.mark.parametrize("index", range(len(INTERPRETED)), ids=[c.name for c in INTERPRETED])
def test_triton_kernel_matches_torch(interpreted, index):
    case = INTERPRETED[index]
    result, after = interpreted[0][index]
    check(case, build(case), result, after)


@pytest.mark.parametrize("index", range(len(_bad_calls())), ids=[b[0] for b in _bad_calls()])
def test_triton_path_refuses_bad_arguments(interpreted, index):
    message = interpreted[1][index]
    assert message, f"{_bad_calls()[index][0]}: accepted"


# The torch path is the decoder blocks' ops, bit for bit (bfloat16 on CPU, with and without the layer-norm tables).

def _norm_tables(weight: torch.Tensor, doubled: bool) -> torch.Tensor | None:
    return layers.doubled_norm_weight(weight) if doubled else None


@pytest.mark.parametrize("doubled", [True, False])
def test_torch_norms_are_the_blocks_norms(doubled):
    args = build(Case("norm_add_rms_norm", "gemma3-1b", 5))
    x, residual, w, bw = args["branch"], args["residual"], args["weight"], args["branch_weight"]
    table, branch_table = _norm_tables(w, doubled), _norm_tables(bw, doubled)
    # the blocks' RMSNorm module: the layer-norm table on CPU, else (as on the GPU) float32 rms_norm
    if doubled:
        module = layers.RMSNorm(x.shape[-1], EPS)
        module.weight.data = w.float()
        module.refresh()
        block_norm = module(x)
    else:
        block_norm = torch.rms_norm(x.float(), [x.shape[-1]], w.float(), EPS).to(x.dtype)
    assert torch.equal(fused_kernels_torch.rms_norm(x, w, EPS, table), block_norm)
    summed = residual + x  # llama: x = x + attn(...), then post_attention_layernorm(x)
    got = fused_kernels_torch.add_rms_norm(x, residual, w, EPS, table)
    assert torch.equal(got[1], summed) and torch.equal(got[0], fused_kernels_torch.rms_norm(summed, w, EPS, table))
    first = fused_kernels_torch.add_rms_norm(x, None, w, EPS, table)
    assert first[1] is x and torch.equal(first[0], block_norm)
    # gemma3: x = x + post_attention_layernorm(attn(...)), then pre_feedforward_layernorm(x)
    sandwich = residual + fused_kernels_torch.rms_norm(x, bw, EPS, branch_table)
    got = fused_kernels_torch.norm_add_rms_norm(x, residual, bw, w, EPS, branch_table, table)
    assert torch.equal(got[1], sandwich)
    assert torch.equal(got[0], fused_kernels_torch.rms_norm(sandwich, w, EPS, table))


# The blocks call fused_kernels' rope_and_write_kv and gated_activation themselves (engine/model/layers.py), so the
# torch path is the blocks' maths by construction; tests/engine/model/test_parity.py checks the blocks against
# transformers.


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("call", ["rms_norm", "add_rms_norm", "norm_add_rms_norm", "rope_and_write_kv",
                                  "gated_activation"])
def test_public_calls_script_and_run_on_cpu(call):
    """Scripted (as the CPU decoder stack is) and eager, on CPU without the interpreter: the torch path's result,
    bit for bit, or with the compiled CPU kernels (tests/engine/kernels/test_cpu_kernels.py) within the kernels'
    contract."""
    case = Case(call, "gemma3-1b" if call in ("norm_add_rms_norm", "rope_and_write_kv") else "llama-1b", 3)
    args = build(case)
    want, want_after = expected(case, args)
    for fn in (torch.jit.script(getattr(fused_kernels, call)), getattr(fused_kernels, call)):
        mine = copied(args)
        got = fn(**mine)
        if fused_kernels.CPU_KERNELS:
            check(case, args, got, mine)
            continue
        for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            assert torch.equal(a, b)
        assert all(torch.equal(mine[k], want_after[k]) for k in mine if isinstance(mine[k], torch.Tensor))


def test_rope_needs_both_norm_weights():
    args = build(Case("rope_and_write_kv", "llama-1b", 1))
    with pytest.raises(ValueError, match="together"):
        fused_kernels.rope_and_write_kv(**args, k_norm_weight=torch.ones(64))
