"""Settings' kernel switches: the engine's environment variables (EMBERSERVE_GEMV, EMBERSERVE_FUSED_KERNELS,
EMBERSERVE_CPU_KERNELS, EMBERSERVE_KERNEL_CACHE) read as the engine reads them, and handed to it as KernelSwitches."""
from __future__ import annotations

from pathlib import Path

import pytest

from engine.kernels.switches import KernelSwitches
from server.config.settings import Settings


def test_the_engines_variables_set_the_kernel_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().kernel_switches == KernelSwitches()
    for name in ("GEMV", "FUSED_KERNELS", "CPU_KERNELS"):
        monkeypatch.setenv(f"EMBERSERVE_{name}", "0")
    monkeypatch.setenv("EMBERSERVE_KERNEL_CACHE", "/tmp/kernels")
    assert Settings().kernel_switches == KernelSwitches(False, False, False, Path("/tmp/kernels"))


@pytest.mark.parametrize("value", ["1", "", "yes", "false"])
def test_a_switch_is_off_only_at_zero_as_in_the_engine(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("EMBERSERVE_GEMV", value)
    monkeypatch.setenv("EMBERSERVE_KERNEL_CACHE", "")
    assert Settings().gemv is True and Settings().kernel_cache is None


def test_a_flag_overrides_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBERSERVE_GEMV", "0")
    assert Settings(gemv=True).kernel_switches.gemv is True
