"""The serving install's size and time: `make install` (what `make serve` installs) into a fresh virtualenv, then
the venv's size on disk, its largest packages, and a check against a budget.

    python bench/install_size.py --max-gb 1.2          (or `make install-size`)

The figure depends on where torch comes from: the Makefile takes torch's CPU build where no NVIDIA driver is found
(PyPI's Linux wheel is the CUDA build); this script reports which build it got.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def tree_bytes(path: Path) -> int:
    """Bytes of the regular files under `path` (links not followed), as `du --apparent-size -b` counts them."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            p = Path(root) / name
            if not p.is_symlink():
                total += p.stat().st_size
    return total


def largest_packages(site: Path, count: int) -> list[tuple[str, int]]:
    sizes = [(p.name, tree_bytes(p) if p.is_dir() else p.stat().st_size) for p in site.iterdir()]
    return sorted(sizes, key=lambda item: -item[1])[:count]


def measure(python: str, keep: Path | None) -> dict:
    work = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="emberserve-install-"))
    venv = work / "venv"
    started = time.monotonic()
    # The Makefile's own recipe: one definition of the serving install. Its editable install points at this
    # checkout, so the venv holds the dependencies, the model package and the project's link, not a copy of it.
    subprocess.run(["make", "-C", str(REPO), "install", f"VENV={venv}", f"PYTHON={python}"], check=True)
    seconds = time.monotonic() - started
    site = next(venv.glob("lib/python*/site-packages"))
    torch_build = subprocess.run([str(venv / "bin" / "python"), "-c", "import torch; print(torch.__version__)"],
                                 capture_output=True, text=True, check=True).stdout.strip()
    dev_tools = [name for name in ("transformers", "pytest", "triton", "openai", "schemathesis")
                 if any(site.glob(f"{name}-*.dist-info"))]
    return {"venv_bytes": tree_bytes(venv), "seconds": round(seconds, 1), "torch": torch_build,
            "dev_tools_installed": dev_tools, "largest": largest_packages(site, 8), "path": str(venv)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-gb", type=float, default=None, help="fail (exit 1) past this many GB (10^9 bytes)")
    parser.add_argument("--python", default=sys.executable, help="the interpreter the venv is made from")
    parser.add_argument("--keep", type=Path, default=None, help="install into this directory and keep it")
    args = parser.parse_args()
    result = measure(args.python, args.keep)
    gb = result["venv_bytes"] / 1e9
    print(f"serving install: {gb:.2f} GB in {result['seconds']:.0f} s (torch {result['torch']})")
    for name, size in result["largest"]:
        print(f"  {size / 1e6:8.1f} MB  {name}")
    print(json.dumps(result))
    failed = []
    if result["dev_tools_installed"]:
        failed.append(f"development tools in the serving install: {', '.join(result['dev_tools_installed'])}")
    if args.max_gb is not None and gb > args.max_gb:
        failed.append(f"{gb:.2f} GB is over the budget of {args.max_gb} GB")
    for reason in failed:
        print(f"FAIL: {reason}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
