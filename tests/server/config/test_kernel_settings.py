"""Settings' kernel switches: the engine's environment variables (EMBERSERVE_GEMV, EMBERSERVE_FUSED_KERNELS,
EMBERSERVE_CPU_KERNELS, EMBERSERVE_KERNEL_CACHE) read as the engine reads them, and handed to it as KernelSwitches."""
from __future__ import annotations

import os
import subprocess
import sys
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


_FLAG_IN_FORCE = """
import os
from server.config.settings import Settings
from server.launch.cli import apply_kernel_switches
apply_kernel_switches(Settings(cpu_kernels=False, gemv=False))
import engine.kernels.fused as fused
from engine.kernels import switches
assert not fused.CPU_KERNELS and not switches.SWITCHES.gemv
assert os.environ["EMBERSERVE_CPU_KERNELS"] == "0" and os.environ["EMBERSERVE_GEMV"] == "0"
print("ok")
"""


def test_the_command_lines_switches_hold_before_the_kernels_load() -> None:
    """`emberserve serve --no-cpu-kernels` (the compiled CPU kernels are chosen when the kernels are first imported):
    the command line puts the switches in force before it imports the app, and in the environment of the processes
    it starts."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBERSERVE_")}
    done = subprocess.run([sys.executable, "-c", _FLAG_IN_FORCE], capture_output=True, text=True, timeout=120,
                          env=env, cwd=Path(__file__).resolve().parents[3])
    assert done.stdout.strip() == "ok", done.stderr[-2000:]


def test_the_command_line_module_imports_no_kernels() -> None:
    """What lets the switches hold: importing the command line imports neither the engine's kernels nor torch."""
    code = "import sys, server.launch.cli; print('engine.kernels.fused' in sys.modules, 'torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[3])
    assert done.stdout.split() == ["False", "False"], done.stderr[-2000:]
