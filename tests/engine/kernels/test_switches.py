"""engine/kernels/switches.py: the engine's kernel switches start from the environment as the engine always read it
(off only at "0"), `configure` puts others in force, and the CPU kernels' switch, once decided, stays."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest

from engine.kernels import gemv, switches
from engine.kernels.switches import KernelSwitches


def test_the_environment_gives_the_standalone_defaults() -> None:
    assert KernelSwitches.from_environ({}) == KernelSwitches(True, True, True, None)
    off = {"EMBERSERVE_GEMV": "0", "EMBERSERVE_FUSED_KERNELS": "0", "EMBERSERVE_CPU_KERNELS": "0",
           "EMBERSERVE_KERNEL_CACHE": "/tmp/k"}
    assert KernelSwitches.from_environ(off) == KernelSwitches(False, False, False, Path("/tmp/k"))
    on = {"EMBERSERVE_GEMV": "false", "EMBERSERVE_CPU_KERNELS": "", "EMBERSERVE_KERNEL_CACHE": ""}
    assert KernelSwitches.from_environ(on) == KernelSwitches(True, True, True, None)  # only "0" turns one off


def test_configure_puts_switches_in_force_but_keeps_the_decided_cpu_kernels(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(switches, "SWITCHES", KernelSwitches())
    monkeypatch.setattr(switches, "_cpu_kernels_decided", False)
    switches.configure(KernelSwitches(gemv=False, kernel_cache=Path("/tmp/k")))
    assert switches.SWITCHES.gemv is False and switches.SWITCHES.kernel_cache == Path("/tmp/k")
    assert gemv.switches.SWITCHES is switches.SWITCHES  # what gemv.serves reads at each call
    assert switches.decide_cpu_kernels() is True
    with caplog.at_level(logging.WARNING, logger="emberserve.engine"):
        switches.configure(KernelSwitches(cpu_kernels=False))
    assert switches.SWITCHES.cpu_kernels is True and "EMBERSERVE_CPU_KERNELS" in caplog.text
