"""`KernelSwitches`: which of the engine's own kernels serve, and where the compiled CPU kernels are cached. The one
place the engine reads them from the environment: `SWITCHES` starts from EMBERSERVE_GEMV, EMBERSERVE_FUSED_KERNELS,
EMBERSERVE_CPU_KERNELS and EMBERSERVE_KERNEL_CACHE (a switch is off only at "0"), so that the engine used on its
own behaves as it always did. The server's `Settings` (server/config/settings.py, the same variable names, and
flags) override them: it calls `configure` before it loads a model (server/scheduling/loading.py).

`gemv`, `fused_kernels` and `kernel_cache` are read at each use. `cpu_kernels` is read once, when the CPU kernels
are first asked for (engine/kernels/fused.py does at import, and the scripted CPU stack compiles it in as a
constant): a later `configure` that changes it only warns.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

log = logging.getLogger("emberserve.engine")


@dataclass(frozen=True)
class KernelSwitches:
    gemv: bool = True           # the Triton GEMV for one-row CUDA matmuls (engine/kernels/gemv.py); EMBERSERVE_GEMV
    fused_kernels: bool = True  # the fused Triton kernels (engine/kernels/fused.py); EMBERSERVE_FUSED_KERNELS
    cpu_kernels: bool = True    # the compiled CPU kernels (engine/kernels/cpu.py); EMBERSERVE_CPU_KERNELS
    kernel_cache: Path | None = None  # where the CPU kernels' build is kept (None: ~/.cache/emberserve); EMBERSERVE_KERNEL_CACHE

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> KernelSwitches:
        return cls(gemv=environ.get("EMBERSERVE_GEMV", "1") != "0",
                   fused_kernels=environ.get("EMBERSERVE_FUSED_KERNELS", "1") != "0",
                   cpu_kernels=environ.get("EMBERSERVE_CPU_KERNELS", "1") != "0",
                   kernel_cache=Path(environ["EMBERSERVE_KERNEL_CACHE"]) if environ.get("EMBERSERVE_KERNEL_CACHE")
                   else None)

    def as_environ(self) -> dict[str, str]:
        """These switches as the variables `from_environ` reads (for processes started from this one)."""
        out = {"EMBERSERVE_GEMV": "1" if self.gemv else "0",
               "EMBERSERVE_FUSED_KERNELS": "1" if self.fused_kernels else "0",
               "EMBERSERVE_CPU_KERNELS": "1" if self.cpu_kernels else "0"}
        if self.kernel_cache is not None:
            out["EMBERSERVE_KERNEL_CACHE"] = str(self.kernel_cache)
        return out


SWITCHES = KernelSwitches.from_environ()  # in force now: the environment's, until `configure`
_cpu_kernels_decided = False


def configure(switches: KernelSwitches) -> None:
    """Put `switches` in force (the server, from its Settings, before loading a model)."""
    global SWITCHES
    if _cpu_kernels_decided and switches.cpu_kernels != SWITCHES.cpu_kernels:
        log.warning("the compiled CPU kernels were already %s when configured %s: set EMBERSERVE_CPU_KERNELS in the "
                    "environment instead", "on" if SWITCHES.cpu_kernels else "off",
                    "on" if switches.cpu_kernels else "off")
        switches = replace(switches, cpu_kernels=SWITCHES.cpu_kernels)
    SWITCHES = switches


def decide_cpu_kernels() -> bool:
    """Whether the compiled CPU kernels are on, fixed from this first call on (engine/kernels/cpu.py's `available`)."""
    global _cpu_kernels_decided
    _cpu_kernels_decided = True
    return SWITCHES.cpu_kernels
