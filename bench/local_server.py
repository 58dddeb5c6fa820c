"""Start `python -m server serve` on a free 127.0.0.1 port for a benchmark, and wait until it is ready."""
from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def start_local_server(*serve_args: str, timeout: float = 120, cwd: Path | None = None,
                       poll_s: float = 0.2) -> tuple[subprocess.Popen, str]:
    """(the server process, its base URL) once /health answers 200 (asked every `poll_s`); the caller terminates the
    process. `cwd`: the checkout whose `server` package runs (default: the current directory's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "server", "serve", "--port", str(port), "--log-level", "warning",
                             *serve_args], cwd=cwd)
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:  # it refused its arguments or failed to load: say so now
            raise RuntimeError(f"server exited with code {proc.returncode} before it was ready")
        try:
            if httpx.get(f"{base_url}/health").status_code == 200:
                return proc, base_url
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    proc.terminate()
    raise RuntimeError(f"server not ready after {timeout}s")
