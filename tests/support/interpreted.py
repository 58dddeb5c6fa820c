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
