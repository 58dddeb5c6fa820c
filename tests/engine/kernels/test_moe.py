"""engine/kernels/moe.py: the Triton fused-experts kernels (run by Triton's CPU interpreter) against `moe_reference`,
and `moe_reference` against the MoE formula token by token in float64; dense float32 / bfloat16, MXFP4 and int4
stacks (dequantized by tests/support/moe_cases.py from the specification), biases and gpt-oss's clamped SwiGLU,
routing edge cases; the alignment's slots against a sort written here, and its static shapes.

TRITON_INTERPRET=1 has to be set before the kernels are defined and must not leak into other tests, so the
interpreted calls run in one subprocess (tests/support/interpreted.py). On a GPU: tests/gpu/test_moe_kernel_cuda.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from engine.kernels import moe
from tests.support import moe_cases
from tests.support.interpreted import BFLOAT16_DOTS, ROUND_TO_NEAREST_EVEN, run_interpreted

E, K, H, I = 8, 2, 64, 32
F32, BF16 = torch.float32, torch.bfloat16


@dataclass(frozen=True)
class Problem:
    name: str
    n: int
    dtype: torch.dtype = F32
    format: str = "dense"
    bias: bool = False
    activation: str = "silu"
    route: str = "topk"       # topk | one-expert | unused-experts | foreign-ids
    config: tuple | None = None  # (block_m, gate_up (n, k, warps, stages), down (...), align_chunk)
    hidden: int = H
    inter: int = I
    strided_x: bool = False


PROBLEMS = [
    Problem("f32-n1", 1), Problem("f32-n3", 3), Problem("f32-n17", 17),
    Problem("bf16-n1", 1, BF16), Problem("bf16-n17", 17, BF16),
    Problem("f32-bias-swiglu-n17", 17, bias=True, activation="swiglu_clamp"),
    Problem("bf16-bias-swiglu-n3", 3, BF16, bias=True, activation="swiglu_clamp"),
    Problem("f32-one-expert-n17", 17, route="one-expert"),
    Problem("f32-unused-experts-n17", 17, route="unused-experts"),
    Problem("f32-foreign-ids-n3", 3, route="foreign-ids"),
    Problem("f32-strided-x-n3", 3, strided_x=True),
    Problem("mxfp4-f32-n17", 17, format="mxfp4"),
    Problem("mxfp4-bf16-bias-swiglu-n1", 1, BF16, "mxfp4", bias=True, activation="swiglu_clamp"),
    Problem("mxfp4-bf16-bias-swiglu-n17", 17, BF16, "mxfp4", bias=True, activation="swiglu_clamp"),
    Problem("int4-f32-n17", 17, format="int4"),
    Problem("int4-bf16-n3", 3, BF16, "int4"),
    # the two-launch alignment (3 chunks of 16 pairs)
    Problem("f32-chunks-n17", 17, config=(16, (32, 64, 4, 2), (32, 32, 4, 2), 16)),
    # blocks of 32 slots, inputs no tile divides, outputs past the last full tile
    Problem("f32-ragged-n17", 17, config=(32, (32, 64, 4, 2), (32, 32, 4, 2), 0), hidden=96, inter=48),
    Problem("mxfp4-f32-ragged-n3", 3, format="mxfp4", config=(16, (16, 64, 4, 2), (32, 64, 4, 2), 0), hidden=96),
]
LIMIT = 0.8  # small enough that the clamps of swiglu_clamp engage on these activations
ALPHA = 1.702


def _ids(p: Problem, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids, weights = moe_cases.routing(p.n, E, K, gen)
    if p.route == "one-expert":
        ids = torch.full_like(ids, 5)  # both of every token's picks: one run of 2n pairs
    elif p.route == "unused-experts":
        ids = torch.tensor([1, 2, 3, 6])[torch.randint(0, 4, ids.shape, generator=gen)]
    elif p.route == "foreign-ids":
        ids[0, 1], ids[-1, 0] = -1, E  # another rank's experts: no contribution
    return ids, weights


def _stack(fmt: str, e: int, out: int, inp: int, gen: torch.Generator, dtype: torch.dtype):
    if fmt == "mxfp4":
        return moe_cases.mxfp4_stack(e, out, inp, gen)
    if fmt == "int4":
        return moe_cases.int4_stack(e, out, inp, gen)
    return moe_cases.dense_stack(e, out, inp, gen, dtype)


def build(index: int) -> dict:
    """The call's arguments, weight stacks as ExpertWeights tuples' fields (what torch.load reads back)."""
    p = PROBLEMS[index]
    gen = torch.Generator().manual_seed(index)
    x = torch.randn(p.n, p.hidden * (2 if p.strided_x else 1), generator=gen).to(p.dtype)
    ids, weights = _ids(p, gen)
    gate_up = _stack(p.format, E, 2 * p.inter, p.hidden, gen, p.dtype)
    down = _stack(p.format, E, p.hidden, p.inter, gen, p.dtype)
    as_tuple = (lambda w: tuple(w)) if p.format != "dense" else (lambda w: w)
    return {"x": x[:, :p.hidden], "topk_ids": ids, "topk_weights": weights,
            "gate_up": as_tuple(gate_up), "down": as_tuple(down),
            "gate_up_bias": (torch.randn(E, 2 * p.inter, generator=gen) * 0.3).to(p.dtype) if p.bias else None,
            "down_bias": (torch.randn(E, p.hidden, generator=gen) * 0.3).to(p.dtype) if p.bias else None,
            "activation": p.activation, "alpha": ALPHA, "limit": LIMIT, "config": p.config}


def _weights(w) -> moe.ExpertWeights | torch.Tensor:
    return moe.ExpertWeights(*w) if isinstance(w, tuple) else w


def _dense(w, dtype: torch.dtype) -> torch.Tensor:
    """A stack as float [E, out, in]: quantized ones dequantized from the specification, rounded to `dtype` as the
    kernels round the weights they feed to their dots."""
    return w if isinstance(w, torch.Tensor) else moe_cases.dequantized(moe.ExpertWeights(*w)).float().to(dtype)


ALIGN_ROUTINGS = [  # (name, ids [17, 2], block_m, chunk)
    ("topk", moe_cases.routing(17, E, K, torch.Generator().manual_seed(100))[0], 16, 0),
    ("other-topk", moe_cases.routing(17, E, K, torch.Generator().manual_seed(101))[0], 16, 0),
    ("one-expert", torch.full((17, K), 3), 16, 0),
    ("foreign", torch.tensor([[-1, 2], [8, 2]] * 8 + [[0, 7]]), 16, 0),
    ("topk-chunks", moe_cases.routing(17, E, K, torch.Generator().manual_seed(100))[0], 16, 16),
    ("topk-bm32-chunks", moe_cases.routing(17, E, K, torch.Generator().manual_seed(102))[0].int(), 32, 8),
]


def _bad_calls() -> list[tuple[str, dict]]:
    ok = build(0)
    return [("down-shape", {**ok, "down": ok["down"][:, :, :16]}),
            ("activation", {**ok, "activation": "gelu"}),
            ("weights-shape", {**ok, "topk_weights": ok["topk_weights"][:, :1]}),
            ("float-ids", {**ok, "topk_ids": ok["topk_ids"].float()}),
            ("bias-shape", {**ok, "gate_up_bias": torch.zeros(E, 3)})]


_INTERPRETED_CALLS = ROUND_TO_NEAREST_EVEN + BFLOAT16_DOTS + """
from engine.kernels import moe
calls, aligns, bad = torch.load(sys.argv[1])

def args(call):
    call = dict(call)
    for name in ("gate_up", "down"):
        if isinstance(call[name], tuple):
            call[name] = moe.ExpertWeights(*call[name])
    if call["config"] is not None:
        m, g, d, chunk = call["config"]
        call["config"] = moe.MoeConfig(m, moe.GemmConfig(*g), moe.GemmConfig(*d), chunk)
    return call

results = [moe.fused_experts(**args(call)) for call in calls]
slots = [moe.align(ids, 8, block_m, chunk) for ids, block_m, chunk in aligns]
refusals = []
for call in bad:
    try:
        moe.fused_experts(**args(call))
        refusals.append(None)
    except ValueError as e:
        refusals.append(str(e))
torch.save((results, slots, refusals), sys.argv[2])
"""


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> tuple[list, list, list]:
    """(each problem's output, each alignment's (slots, ends), each bad call's message or None)."""
    return run_interpreted(_INTERPRETED_CALLS,
                           ([build(i) for i in range(len(PROBLEMS))],
                            [(ids, block_m, chunk) for _, ids, block_m, chunk in ALIGN_ROUTINGS],
                            [call for _, call in _bad_calls()]),
                           tmp_path_factory.mktemp("moe"))


# Float32: the float32 products in another order. bfloat16: the kernels round the activation once, the reference
# rounds the gate_up product before it and each expert's output after the down product (a few bf16 ulps).
TOLERANCE = {F32: 2e-6, BF16: 1.2e-2}


@pytest.mark.parametrize("index", range(len(PROBLEMS)), ids=[p.name for p in PROBLEMS])
def test_kernel_equals_the_reference(interpreted, index):
    p = PROBLEMS[index]
    args = build(index)
    result = interpreted[0][index]
    assert result.shape == (p.n, p.hidden) and result.dtype == p.dtype
    del args["config"]
    args["gate_up"], args["down"] = _dense(args["gate_up"], p.dtype), _dense(args["down"], p.dtype)
    expected = moe.moe_reference(**args)
    error = moe_cases.max_error(result, expected)
    assert error <= TOLERANCE[p.dtype], f"relative error {error:.2e}"


@pytest.mark.parametrize("index", [i for i, p in enumerate(PROBLEMS) if p.dtype == F32],
                         ids=[p.name for p in PROBLEMS if p.dtype == F32])
def test_reference_is_the_formula(index):
    """moe_reference in float32 (quantized stacks through the engine's dequantization) against the float64
    definition on the specification's dequantization."""
    args = build(index)
    del args["config"]
    expected = moe_cases.formula(**{**args, "gate_up": _dense(args["gate_up"], torch.float64),
                                    "down": _dense(args["down"], torch.float64)})
    reference = moe.moe_reference(**{**args, "gate_up": _weights(args["gate_up"]), "down": _weights(args["down"])})
    assert moe_cases.max_error(reference, expected) <= 2e-6


@pytest.mark.parametrize("fmt", ["mxfp4", "int4"])
def test_engine_dequantization_is_the_specification(fmt):
    w = _stack(fmt, 3, 8, 64, torch.Generator().manual_seed(7), F32)
    spec = moe_cases.dequantized(w)
    for e in range(3):  # MXFP4 values are exact in float32; int4's code x scale + offset rounds there once or twice
        engine = moe.expert_matrix(w, e, torch.float64)
        assert torch.equal(engine, spec[e]) if fmt == "mxfp4" else torch.allclose(engine, spec[e], rtol=1e-6, atol=1e-7)


def _expected_slots(ids: torch.Tensor, block_m: int) -> tuple[list[int], list[int]]:
    """Each expert's pairs in their order, padded with the number of pairs to a multiple of block_m; the ends."""
    flat = ids.reshape(-1).tolist()
    slots, ends = [], []
    for e in range(E):
        mine = [i for i, x in enumerate(flat) if x == e]
        padded = -(-len(mine) // block_m) * block_m
        slots += mine + [len(flat)] * (padded - len(mine))
        ends.append(len(slots))
    return slots, ends


@pytest.mark.parametrize("index", range(len(ALIGN_ROUTINGS)), ids=[r[0] for r in ALIGN_ROUTINGS])
def test_alignment_groups_the_pairs_by_expert(interpreted, index):
    _, ids, block_m, _ = ALIGN_ROUTINGS[index]
    slots, ends = interpreted[1][index]
    expected_slots, expected_ends = _expected_slots(ids, block_m)
    assert ends.tolist() == expected_ends
    assert slots[:expected_ends[-1]].tolist() == expected_slots
    assert slots.shape == (moe.max_slots(ids.numel(), E, block_m),) and slots.dtype == torch.int32


def test_alignment_shapes_depend_on_the_number_of_pairs_alone(interpreted):
    """The same N routed differently (and all to one expert) gives the same buffers: capturable in a CUDA graph."""
    shapes = {(tuple(s.shape), tuple(e.shape)) for (_, _, bm, _), (s, e) in zip(ALIGN_ROUTINGS, interpreted[1])
              if bm == 16}
    assert shapes == {((moe.max_slots(17 * K, E, 16),), (E,))}


def test_slots_bound_the_worst_routing():
    assert moe.max_slots(8, 128, 16) == 8 * 16  # decode: each of k pairs may open an expert's block
    assert moe.max_slots(16384, 128, 64) == 16384 + 128 * 63


@pytest.mark.parametrize("index", range(len(_bad_calls())), ids=[b[0] for b in _bad_calls()])
def test_kernel_path_refuses_bad_arguments(interpreted, index):
    assert interpreted[2][index], f"{_bad_calls()[index][0]}: accepted"


def test_without_the_interpreter_cpu_calls_take_the_reference():
    args = build(2)
    del args["config"]
    assert not moe.runs_triton(args["x"]) or not torch.cuda.is_available()
    assert torch.equal(moe.fused_experts(**args), moe.moe_reference(**args))
