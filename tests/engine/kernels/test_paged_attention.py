"""engine/kernels/paged_attention.py: the Triton kernels (run by Triton's CPU interpreter) and the torch fallback, against
the float64 reference on random paged problems (tests/support/paged_attention_cases.py).

TRITON_INTERPRET=1 has to be set before the kernels are defined, and must not leak into other tests (nor into
tests/gpu in the same session), so the interpreted calls run in one subprocess per module: the problems are built
here, the subprocess only calls the kernels on them, and everything is compared here.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import paged_attention
from engine.kernels.paged_attention_torch import reference_decode, reference_prefill
from tests.support.interpreted import run_interpreted
from tests.support.paged_attention_cases import DECODE, OUT_FILL, PREFILL, TOLERANCE, Spec, build, claimed

CASES = [(spec, "paged_decode_attention") for spec in DECODE] + [(spec, "paged_prefill_attention") for spec in PREFILL]

# Calls the kernels on the saved problems; prints nothing, writes [(output, output is the given `out`)].
_INTERPRETED_CALLS = """
import sys
import numpy as np
import triton.runtime.interpreter as interpreter
try:
    int(np.zeros(1))
except TypeError:
    # numpy >= 2.4 refuses int() of a 1-element array, which triton 3.6's interpreter does for loop bounds held
    # in tensors (triton-lang/triton#9171, fixed upstream by #9172): the same fix, applied here.
    _patch = interpreter._patch_lang_tensor
    def _patch_lang_tensor(tensor, scope):
        _patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
    interpreter._patch_lang_tensor = _patch_lang_tensor
import torch
from engine.kernels import paged_attention
results = []
for name, kwargs in torch.load(sys.argv[1]):
    out = kwargs.get("out")
    result = getattr(paged_attention, name)(**kwargs, backend="triton")
    results.append((result, out is None or result.data_ptr() == out.data_ptr()))
torch.save(results, sys.argv[2])
"""


def _problem(spec: Spec) -> dict:
    return build(spec, seed=sum(map(ord, spec.name)))


def _expected(spec: Spec, args: dict) -> torch.Tensor:
    plain = {k: v for k, v in args.items() if k not in ("out", "segments", "max_query_len")}
    return reference_decode(**plain) if spec.decode else reference_prefill(**plain)


def _check(spec: Spec, args: dict, result: torch.Tensor) -> None:
    assert result.dtype == spec.dtype and result.shape == args["q"].shape
    expected = _expected(spec, args)
    result = result.double()
    if not spec.decode:  # tokens no row claims keep the buffer's contents
        mine = claimed(spec, result.shape[0])
        assert torch.equal(result[~mine], torch.full_like(result[~mine], OUT_FILL))
        result, expected = result[mine], expected[mine]
    assert torch.isfinite(result).all()
    err = float((result - expected).abs().max()) if result.numel() else 0.0
    assert err <= TOLERANCE[spec.dtype], f"{spec.name}: max abs error {err:.2e} > {TOLERANCE[spec.dtype]:.0e}"
    if spec.decode:  # padding rows give zeros
        padding = args["seq_lens"] == 0
        assert torch.equal(result[padding], torch.zeros_like(result[padding]))


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> list[tuple[torch.Tensor, bool]]:
    """[(output, whether it is the caller's `out`)] of every case, from the kernels under TRITON_INTERPRET=1."""
    return run_interpreted(_INTERPRETED_CALLS, [(name, _problem(spec)) for spec, name in CASES],
                           tmp_path_factory.mktemp("paged_attention"))


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"{n.split('_')[1]}-{s.name}" for s, n in CASES])
def test_triton_kernel_matches_reference(interpreted, index):
    spec, _ = CASES[index]
    result, is_out = interpreted[index]
    _check(spec, _problem(spec), result)
    assert is_out, "the result must be the `out` buffer passed in"


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"{n.split('_')[1]}-{s.name}" for s, n in CASES])
def test_torch_fallback_matches_reference(index):
    spec, name = CASES[index]
    args = _problem(spec)
    out = args.get("out")
    result = getattr(paged_attention, name)(**args, backend="torch")
    _check(spec, args, result)
    assert out is None or result is out


def test_reference_is_attention():
    """The reference itself, on one row laid out in consecutive blocks, against torch's SDPA (causal, GQA)."""
    spec = Spec("plain", lens=(48,), query_lens=(48,), heads=8, kv_heads=2, extra_width=0)
    args = build(spec, seed=3)
    keys, values = args["keys"][:, :48].double(), args["values"][:, :48].double()
    args["block_tables"] = torch.arange(3, dtype=torch.int32).unsqueeze(0)
    args["keys"][:, :48], args["values"][:, :48] = keys.float(), values.float()
    q = args["q"].double()
    sdpa = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(reference_prefill(**args), sdpa.transpose(0, 1))
    last = dict(args, q=args["q"][-1:])
    for k in ("query_lens", "query_starts"):
        last.pop(k)
    torch.testing.assert_close(reference_decode(**last), sdpa.transpose(0, 1)[-1:])


@pytest.mark.parametrize("batch", [1, 3, 8, 32, 256])
@pytest.mark.parametrize("max_keys", [64, 384, 4096])
def test_decode_segments_fill_the_gpu(batch, max_keys):
    """The decode split of an H200 (132 SMs, 8 KV heads): enough programs to cover the SMs when the table has the
    tiles, never more parts than tiles, and none at all once the rows alone fill the GPU."""
    sms, kv_heads, block_n = 132, 8, 64
    segments = paged_attention.decode_segments(batch, kv_heads, max_keys, block_n, sms)
    tiles = -(-max_keys // block_n)
    assert 1 <= segments <= min(tiles, paged_attention.MAX_SEGMENTS)
    if batch * kv_heads >= sms:
        assert segments == 1
    else:
        assert batch * kv_heads * segments >= min(sms, batch * kv_heads * min(tiles, paged_attention.MAX_SEGMENTS))


def test_rejects_inputs_that_do_not_fit():
    args = _problem(DECODE[0])
    with pytest.raises(ValueError, match="multiple of the KV heads"):
        paged_attention.paged_decode_attention(**dict(args, q=args["q"][:, :3]))
    with pytest.raises(ValueError, match="share a dtype"):
        paged_attention.paged_decode_attention(**dict(args, q=args["q"].double()))
    with pytest.raises(ValueError, match="whole blocks"):
        paged_attention.paged_decode_attention(**dict(args, block_size=7))
