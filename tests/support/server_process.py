"""Starting and stopping a real emberserve process on a free 127.0.0.1 port, for the e2e tests."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

MODEL = "smollm2-135m"
# The float32 path: dequantized weights, outputs that match the in-process float32 engine bit for bit.
EXACT = ("--dtype", "float32")
STARTUP_TIMEOUT_S = 120
LOGGED_WITHIN_S = 10.0  # how long `ServerProcess.access_records` waits for the records it is asked for


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    process: subprocess.Popen
    base_url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def access_records(self, count: int = 0, **fields: Any) -> list[dict[str, Any]]:
        """The access-log records (`--log-format json`) whose `fields` have these values, in order, once there are
        at least `count` of them (waited for: a record is written once its response has ended, which can be a
        moment after the client has read the whole response)."""
        deadline = time.monotonic() + LOGGED_WITHIN_S
        while True:
            whole_lines = self.log().rpartition("\n")[0].splitlines()  # not a line still being written
            records = [r for r in map(json.loads, (line for line in whole_lines if line.startswith("{")))
                       if r.get("logger") == "emberserve.access" and all(r.get(k) == v for k, v in fields.items())]
            if len(records) >= count:
                return records
            assert time.monotonic() < deadline, f"{len(records)} of {count} access records {fields} logged"
            time.sleep(0.05)


def start_server(tmp: Path, *args: str, wait: bool = True, env: dict[str, str] | None = None,
                 entry: tuple[str, ...] = ("-m", "server")) -> ServerProcess:
    """Start `python -m server serve` (or `python *entry serve`) on a free port (`env` added to the environment);
    with `wait`, return once /health answers 200."""
    port = free_port()
    log_path = tmp / f"server-{port}.log"
    cmd = [sys.executable, *entry, "serve", "--port", str(port), *args]
    proc = subprocess.Popen(cmd, stdout=log_path.open("wb"), stderr=subprocess.STDOUT,
                            cwd=Path(__file__).resolve().parents[2], env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    server = ServerProcess(proc, f"http://127.0.0.1:{port}", log_path)
    if wait:
        wait_ready(server)
    return server


def wait_ready(server: ServerProcess, timeout: float = STARTUP_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"server exited with {server.process.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"server not ready after {timeout}s:\n{server.log()}")


def stop_server(server: ServerProcess) -> None:
    server.process.terminate()
    try:
        server.process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()


def health_while_exiting(base_url: str) -> dict | None:
    """/health of a server on its way out after a failure: its 503 body, or None once it no longer answers."""
    try:
        answer = httpx.get(f"{base_url}/health", timeout=5)
    except httpx.TransportError:
        return None
    assert answer.status_code == 503, answer.text
    return answer.json()
