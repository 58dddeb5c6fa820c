"""The GPU benchmark's peer: llama.cpp's own llama-server, on the same random weights as emberserve.

bench/gpu.py's `peer` part converts the shape's safetensors directory with llama.cpp's `convert_hf_to_gguf.py`
(through bench/peer_convert.py) and serves the GGUF with llama-server; the same client then drives it as it drove
our server. The source and the build come from bench/gpu_moe.sh (`build`: the llama-cpp-python 0.3.36 sdist's
vendored llama.cpp, carried as .peer/llama.cpp.tar.gz, built with CUDA under /tmp so that later calls on the warm
machine reuse it); ../shared/reference/gpu.md has the flags.
"""
from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import httpx

HERE = Path(__file__).resolve().parent
PEER_ROOT = Path(os.environ.get("PEER_ROOT", "/tmp/emberserve-peer"))
DEFAULT_SOURCE = PEER_ROOT / "llama.cpp"  # the tarball's llama.cpp directory, unpacked
DEFAULT_BINARY = PEER_ROOT / "build" / "bin" / "llama-server"
DEFAULT_ARGS = "-ngl 999 -fa on -np 128 -c 131072"  # gpu.md: every layer on the GPU, flash attention, 128 slots


@dataclass(frozen=True)
class PeerOptions:
    source: Path = DEFAULT_SOURCE
    binary: Path = DEFAULT_BINARY
    outtype: str = "f16"  # what the converter writes for the float tensors (MXFP4 experts stay MXFP4)
    args: str = DEFAULT_ARGS


def gguf_bytes_estimate(model_dir: Path) -> int:
    """The GGUF's size: about the safetensors' (bfloat16 to f16 and MXFP4 to MXFP4 keep their sizes)."""
    return sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))


class Conversion:
    """llama.cpp's converter running on `model_dir` into `out`, started at once (at `nice`, so that it can run
    beside timed work), its outcome from `result`."""

    def __init__(self, model_dir: Path, out: Path, opts: PeerOptions, nice: int = 0) -> None:
        self.out, self.log_path = out, out.with_suffix(".convert.log")
        self.cmd = [sys.executable, str(HERE / "peer_convert.py"), str(opts.source), str(model_dir),
                    "--outtype", opts.outtype, "--outfile", str(out)]
        self.nice = nice
        self.t0 = time.monotonic()
        self.proc: subprocess.Popen | None = None
        if not (opts.source / "convert_hf_to_gguf.py").is_file():
            self.error = f"no llama.cpp source at {opts.source} (bench/gpu_moe.sh build unpacks it)"
            return
        self.error = ""
        with self.log_path.open("wb") as f:
            self.proc = subprocess.Popen(self.cmd, stdout=f, stderr=subprocess.STDOUT,
                                         preexec_fn=(lambda: os.nice(nice)) if nice else None)

    def result(self, timeout: float) -> dict:
        """{"convert_s", "gguf_bytes", "convert_command"} or {"error"}, waiting at most `timeout` seconds."""
        if self.proc is None:
            return {"error": self.error}
        try:
            code = self.proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            self.out.unlink(missing_ok=True)
            return {"error": f"conversion not done within {timeout:.0f}s"}
        if code != 0 or not self.out.is_file():
            return {"error": f"converter exited with {code}: {self.log_path.read_text(errors='replace')[-1500:]}"}
        return {"convert_s": round(time.monotonic() - self.t0, 1), "gguf_bytes": self.out.stat().st_size,
                "convert_command": self.cmd, "convert_nice": self.nice}

    def cancel(self) -> None:
        """Stop it if it still runs, and remove its partial GGUF."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
            self.out.unlink(missing_ok=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """llama-server on `gguf` (a context manager): started, waited for until /health answers 200, stopped."""

    def __init__(self, gguf: Path, opts: PeerOptions, log_path: Path) -> None:
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.cmd = [str(opts.binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port),
                    "--alias", gguf.stem, *shlex.split(opts.args)]
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self, ready_within: float, log: Callable[[str], None]) -> float:
        """Seconds until it answered /health; raises RuntimeError if it exited or did not answer in time."""
        log(f"  starting {' '.join(self.cmd)}")
        env = {**os.environ, "LD_LIBRARY_PATH": ":".join(
            filter(None, [str(Path(self.cmd[0]).parent), os.environ.get("LD_LIBRARY_PATH")]))}
        t0 = time.monotonic()
        with self.log_path.open("wb") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}: {self.tail()}")
            if time.monotonic() - t0 > ready_within:
                raise RuntimeError(f"llama-server not ready within {ready_within:.0f}s: {self.tail()}")
            try:
                if httpx.get(f"{self.base}/health", timeout=2).status_code == 200:
                    return round(time.monotonic() - t0, 1)
            except httpx.HTTPError:
                pass
            time.sleep(0.5)

    def tail(self, chars: int = 1500) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.is_file() else ""

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> LlamaServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def version(opts: PeerOptions) -> str | None:
    """llama-server --version's line (the build's commit), or None."""
    if not opts.binary.is_file():
        return None
    try:
        env = {**os.environ, "LD_LIBRARY_PATH": str(opts.binary.parent)}
        done = subprocess.run([str(opts.binary), "--version"], capture_output=True, text=True, timeout=30, env=env)
        lines = [line for line in (done.stdout + done.stderr).splitlines() if "version" in line]
        return lines[0].strip() if lines else None
    except (OSError, subprocess.SubprocessError):
        return None


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
