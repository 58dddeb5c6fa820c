"""Running Triton kernels under its CPU interpreter from a test: TRITON_INTERPRET=1 has to be set before the kernels
are defined and must not leak into other tests, so the calls run in one subprocess on problems built by the test."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

# The head of an interpreted script whose kernels round float32 to bfloat16: the interpreter rounds toward zero (and
# its "rtne" rounds ties away from zero); the GPU's conversion, which the kernels rely on to round where torch
# rounds, is round-to-nearest-even: do that.
ROUND_TO_NEAREST_EVEN = """
import sys
import numpy as np
import torch
import triton.language as tl
import triton.runtime.interpreter as interpreter

_convert_float = interpreter._convert_float
def _round_to_nearest_even(data, src, dst, rounding_mode):
    if src == tl.float32 and dst == tl.bfloat16:
        as_float = torch.from_numpy(np.ascontiguousarray(data).view(np.float32))
        return as_float.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return _convert_float(data, src, dst, rounding_mode)
interpreter._convert_float = _round_to_nearest_even
"""

# The head of an interpreted script whose kernels take bfloat16 dots: the interpreter multiplies bfloat16 operands
# as the integers that hold their bits; widen them to float32 first (exactly), as the GPU's dot does.
BFLOAT16_DOTS = """
import numpy as np
import triton.language as tl
import triton.runtime.interpreter as interpreter

_create_dot = interpreter.InterpreterBuilder.create_dot
def _widened_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    def widen(h):
        if h.dtype != tl.bfloat16:
            return h
        return interpreter.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
    return _create_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)
interpreter.InterpreterBuilder.create_dot = _widened_dot
"""


def run_interpreted(script: str, inputs: Any, tmp: Path) -> Any:
    """What `script` saves to sys.argv[2] after loading `inputs` from sys.argv[1], run with TRITON_INTERPRET=1 from
    the repository root; skips the test where triton is not installed."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed: the kernels cannot be interpreted")
    torch.save(inputs, tmp / "calls.pt")
    proc = subprocess.run([sys.executable, "-c", script, str(tmp / "calls.pt"), str(tmp / "out.pt")],
                          cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"interpreted kernels failed:\n{proc.stderr[-4000:]}"
    return torch.load(tmp / "out.pt")
