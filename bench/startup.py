"""A server's start-up and exit, from outside: seconds from launching `python -m server serve` to /health answering
200 (imports, the model's load, the app), and from SIGTERM to the process's exit.

    python bench/startup.py [--runs 7] [--tree DIR] [--vs DIR] [-- SERVE_ARGS...]

SERVE_ARGS default to `--model smollm2-135m`. `--tree DIR` runs the code of another checkout (its `server` and
`engine` packages, with this interpreter); `--vs DIR` runs this one (or --tree's) and DIR's alternately, start by
start, so a drift of the machine's speed hits both, and prints the medians' ratios. Run it alone: on two cores a
second benchmark beside it measures noise.
"""
from __future__ import annotations

import argparse
import signal
import statistics
import time
from pathlib import Path

from local_server import start_local_server

ROOT = Path(__file__).resolve().parents[1]
POLL_S = 0.02
TIMEOUT_S = 120.0


def start_and_stop(tree: Path, serve_args: list[str]) -> tuple[float, float]:
    """One start: (seconds to ready, seconds from SIGTERM to exit)."""
    started = time.monotonic()
    proc, _ = start_local_server(*serve_args, timeout=TIMEOUT_S, cwd=tree, poll_s=POLL_S)
    ready = time.monotonic() - started
    try:
        stopping = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=TIMEOUT_S)
        return ready, time.monotonic() - stopping
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--tree", type=Path, default=ROOT, help="the checkout whose code runs (default: this one)")
    parser.add_argument("--vs", type=Path, help="a second checkout, run alternately with --tree")
    parser.add_argument("serve_args", nargs="*", help="arguments of `serve` (after --)")
    args = parser.parse_args()
    serve_args = args.serve_args or ["--model", "smollm2-135m"]
    trees = [args.tree] + ([args.vs] if args.vs else [])
    start_and_stop(trees[0], serve_args)  # a warm-up: the page cache holds the model and the libraries
    times: dict[Path, list[tuple[float, float]]] = {t: [] for t in trees}
    for _ in range(args.runs):
        for tree in trees:
            times[tree].append(start_and_stop(tree, serve_args))
    print(f"serve {' '.join(serve_args)}: {args.runs} starts each, seconds (median, min-max)")
    print("| tree | to ready | SIGTERM to exit |\n|---|---|---|")
    medians = {}
    for tree, runs in times.items():
        ready, stop = [r for r, _ in runs], [s for _, s in runs]
        medians[tree] = (statistics.median(ready), statistics.median(stop))
        print(f"| {tree} | {medians[tree][0]:.2f} ({min(ready):.2f}-{max(ready):.2f}) "
              f"| {medians[tree][1]:.2f} ({min(stop):.2f}-{max(stop):.2f}) |")
    if args.vs:
        a, b = medians[args.tree], medians[args.vs]
        print(f"ratio {args.tree.name} / {args.vs.name}: to ready {a[0] / b[0]:.2f}, to exit {a[1] / b[1]:.2f}")


if __name__ == "__main__":
    main()
