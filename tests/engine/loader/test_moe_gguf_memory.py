"""A 4-bit mixture-of-experts GGUF loads in about its own size (issue 36: a 30B MoE at 4 bits must fit in memory,
RSS ≈ the file plus the KV pool): its experts are read from the memory map an expert at a time, never decoded
whole. Measured as anonymous memory in a fresh process (tests/support/memory_probe.py), on a random Qwen3-MoE of
64 experts in Q4_K (tests/support/moe_gguf.py: 2 layers, hidden and expert width 512, 56 MiB).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.moe_gguf import write_random_moe_gguf

ROOT = Path(__file__).resolve().parents[3]
KV_POOL = 1 << 20  # the probe's runner: kv_cache_memory


def _random_moe(path: Path, experts: int) -> Path:
    return write_random_moe_gguf(path, expert_type="Q4_K", other_type="Q8_0", experts=experts, layers=2,
                                 hidden=512, expert_ff=512)


@pytest.fixture(scope="module")
def moe_file(tmp_path_factory) -> Path:
    return _random_moe(tmp_path_factory.mktemp("moe_memory") / "moe-64x.gguf", 64)


def _probe(path: Path, mode: str, *warm: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "tests.support.memory_probe", str(path), mode, *map(str, warm)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_reading_every_expert_holds_no_copy_of_them(moe_file: Path) -> None:
    """load_gguf with 4-bit codes kept, then every expert read once: the experts stay in the map, so the growth is
    the few non-expert tensors and one expert at a time."""
    got = _probe(moe_file, "read")
    assert got["peak"] < 0.25 * moe_file.stat().st_size, got


def test_float_experts_are_filled_in_the_compute_dtype(moe_file: Path) -> None:
    """Materialised as bfloat16 (the float path), the stacks cost their bfloat16 size: never a float32 copy of a
    stack (one would be a third of the bfloat16 total here) on the way."""
    got = _probe(moe_file, "float")
    bf16 = 2 * got["expert_weights"]
    assert bf16 > 3 * moe_file.stat().st_size  # what a dense copy of the experts would cost
    assert got["peak"] < bf16 + 0.25 * moe_file.stat().st_size, got


def test_an_int4_runner_holds_about_its_file_size(moe_file: Path, tmp_path: Path) -> None:
    """The whole load (experts packed as int4 an expert at a time, the rest int8): at its peak and after, about the
    file's size (and the KV pool), over what a first runner of the same architecture costs anyway."""
    got = _probe(moe_file, "runner", _random_moe(tmp_path / "moe-2x.gguf", 2))
    size = moe_file.stat().st_size
    assert got["final"] < 1.25 * size + KV_POOL, got
    assert got["peak"] < 1.5 * size + KV_POOL, got
