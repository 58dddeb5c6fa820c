"""The fused CPU kernels of engine/kernels/csrc/cpu_kernels.cpp: built once per machine, loaded as torch.ops.emberserve.*.

The library is compiled with the system's C++ compiler against the installed torch (torch's own headers and
libraries, as torch.utils.cpp_extension does, without needing ninja) into a cache directory, under a name that
hashes the source, the flags and torch's version: a new source or another torch builds afresh, and a cached build
loads in milliseconds. `make install` builds it (`cpu_kernels.build()`), so a server never compiles on its first
request; a fresh environment that skipped that builds it on first import (seconds).

Without a compiler (or when the build fails) every op is still defined, with the torch ops of
engine/kernels/fused_torch.py as its implementation, so the scripted decoder stack compiles the same either way;
`available()` then says False, and the decoder takes the torch path itself (a warning says why). EMBERSERVE_CPU_KERNELS=0
turns the compiled kernels off (to measure what they bring, or to rule them out).
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch

from engine.kernels import switches

log = logging.getLogger("emberserve.engine")

# The elementwise/attention kernels and the integer-dot-product matmuls (engine/model/quant/dot.py), one library.
SOURCES = tuple(Path(__file__).with_name("csrc") / name for name in ("cpu_kernels.cpp", "int8_dot.cpp"))
_state: dict[str, object] = {"loaded": None, "why": ""}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where it does not)."""
    try:
        return frozenset(Path("/proc/cpuinfo").read_text().split("flags", 2)[1].split("\n", 1)[0].split())
    except (OSError, IndexError):
        return frozenset()


def _arch_flags() -> list[str]:
    """The x86-64 micro-architecture level this CPU has: v4 (AVX-512) or v3 (AVX2, FMA), never -march=native, so
    that a library built on one machine runs on any other of its level (the level is in the library's name, so a
    machine of another level sharing the cache builds its own); the generic target elsewhere."""
    if platform.machine() in ("x86_64", "AMD64"):
        flags = cpu_flags()
        if {"avx2", "fma", "bmi2", "f16c", "movbe"} <= flags:
            if {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"} <= flags:
                return ["-march=x86-64-v4", "-mprefer-vector-width=512"]
            return ["-march=x86-64-v3"]
    return []


CHUNK_KERNEL_HEAD_DIMS = (64, 128, 256)  # the chunk kernel's (chunk_kernel_serves in csrc/cpu_kernels.cpp)


def chunk_attention_kernel(head_dim: int) -> bool:
    """Whether the library's attention at `head_dim` runs the chunk kernel (its AVX-512 build, x86-64-v4): a row's
    queries together over keys transposed in tiles, for decode rows and chunks alike, which beats gathering the
    keys for torch's fused attention at every chunk length
    (bench/RESULTS.md#issue-17-cpu-chunk-attention, bench/RESULTS.md#issue-17-cpu-one-attention-kernel)."""
    return "-march=x86-64-v4" in _arch_flags() and head_dim in CHUNK_KERNEL_HEAD_DIMS


def _flags() -> list[str]:
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    # -fopenmp: at::parallel_for is an inline OpenMP region; without it every kernel ran on one thread. The library
    # then needs libgomp.so.1, which the dynamic linker finds already loaded with torch (the runtime torch uses).
    return ["-O3", "-std=c++17", "-fPIC", "-shared", "-fopenmp", "-fno-trapping-math", "-fno-math-errno",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            "-DTORCH_API_INCLUDE_EXTENSION_H", *_arch_flags()]


def _library_path() -> Path:
    key = hashlib.sha256(b"".join(s.read_bytes() for s in SOURCES) + " ".join(_flags()).encode() + torch.__version__.encode()
                         + sys.version.encode()).hexdigest()[:16]
    root = switches.SWITCHES.kernel_cache or Path.home() / ".cache" / "emberserve"
    return root / f"cpu_kernels-{key}.so"


def build(path: Path | None = None) -> Path:
    """Compile the library (if its cached build is missing) and return its path; raises on failure."""
    path = path or _library_path()
    if path.exists():
        return path
    from torch.utils import cpp_extension  # here: it imports setuptools, a fifth of a second of every start

    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (c++ or g++) on PATH")
    includes = [f"-I{p}" for p in cpp_extension.include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    libs = [f"-L{p}" for p in cpp_extension.library_paths()]
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:  # built aside, moved in whole: no half-written file
        out = Path(tmp) / path.name
        cmd = [compiler, *_flags(), *includes, *map(str, SOURCES), "-o", str(out), *libs, "-lc10", "-ltorch_cpu"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"building {', '.join(s.name for s in SOURCES)} failed:\n{done.stderr[-4000:]}")
        os.replace(out, path)
    return path


def _define_fallbacks() -> None:
    """The ops' schemas with the torch path as their CPU implementation (no compiled library)."""
    from engine.kernels import fused_torch as ref

    lib = torch.library.Library("emberserve", "DEF")
    lib.define("add_rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)")
    lib.define("norm_add_rms_norm(Tensor branch, Tensor residual, Tensor branch_weight, Tensor weight, float eps) "
               "-> (Tensor, Tensor)")
    lib.define("rope_write_kv(Tensor qk, Tensor v, Tensor cos, Tensor sin, Tensor(a!) keys, Tensor(b!) values, "
               "Tensor slots, Tensor? q_norm_weight, Tensor? k_norm_weight, float eps, Tensor(c!)? k_out) -> Tensor")
    lib.define("gated_activation(Tensor gate_up, bool gelu) -> Tensor")
    lib.define("paged_decode_attention(Tensor q, Tensor keys, Tensor values, Tensor block_tables, Tensor seq_lens, "
               "int block_size, float scale, int window, Tensor? sinks=None) -> Tensor")
    lib.define("paged_prefill_attention(Tensor q, Tensor keys, Tensor values, Tensor block_tables, Tensor seq_lens, "
               "Tensor query_lens, Tensor query_starts, int block_size, float scale, int window, Tensor(a!) out, "
               "Tensor? sinks=None) -> Tensor(a!)")

    def norm_weight(w: torch.Tensor, d: int) -> torch.Tensor:
        return w.reshape(-1)[:d]

    lib.impl("add_rms_norm", lambda x, r, w, eps: ref.add_rms_norm(x, r, norm_weight(w, x.shape[-1]), eps), "CPU")
    lib.impl("norm_add_rms_norm", lambda b, r, bw, w, eps: ref.norm_add_rms_norm(
        b, r, norm_weight(bw, b.shape[-1]), norm_weight(w, b.shape[-1]), eps), "CPU")
    lib.impl("rope_write_kv", lambda qk, v, cos, sin, keys, values, slots, qw, kw, eps, k_out: ref.rope_and_write_kv(
        qk, v, cos, sin, keys, values, slots, None if qw is None else norm_weight(qw, qk.shape[-1]),
        None if kw is None else norm_weight(kw, qk.shape[-1]), eps, None, None, k_out), "CPU")
    lib.impl("gated_activation", ref.gated_activation, "CPU")
    from engine.kernels import paged_attention_torch

    lib.impl("paged_decode_attention", lambda q, k, v, t, n, bs, scale, window, sinks=None: (
        paged_attention_torch.decode(q, k, v, t, n, bs, scale, window, sinks)), "CPU")
    lib.impl("paged_prefill_attention", lambda q, k, v, t, n, ql, qs, bs, scale, window, out, sinks=None: (
        paged_attention_torch.prefill(q, k, v, t, n, ql, qs, bs, scale, window, out, sinks), out)[1], "CPU")
    _state["fallback_library"] = lib  # the registrations live as long as the Library object


def available() -> bool:
    """Whether the compiled kernels serve (False: the torch fallbacks; see `why_not`). The first call loads the
    library, building it if needed, or defines the fallbacks."""
    if _state["loaded"] is not None:
        return bool(_state["loaded"])
    loaded = False
    if not switches.decide_cpu_kernels():
        _state["why"] = "EMBERSERVE_CPU_KERNELS=0"
    else:
        try:
            torch.ops.load_library(str(build()))
            loaded = True
        except Exception as e:  # noqa: BLE001 - any failure leaves the torch path, which is the same maths
            _state["why"] = str(e)
            log.warning("the fused CPU kernels are not available, the torch ops serve instead: %s", e)
    if not loaded:
        _define_fallbacks()
    _state["loaded"] = loaded
    return loaded


def why_not() -> str:
    return str(_state["why"])
