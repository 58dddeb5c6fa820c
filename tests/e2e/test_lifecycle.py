"""The server's life: /health while loading and when ready, cancelling work nobody waits for, an event loop that
never runs the model, start-up failures that exit cleanly, and the command line."""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

MODEL = "smollm2-135m"  # the model the session `server` fixture serves
ROOT = Path(__file__).resolve().parents[2]


from tests.support import server_process as helpers  # noqa: E402
LONG = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story about the sea."}],
        "max_tokens": 2000, "ignore_eos": True}


def health(http: httpx.Client) -> dict[str, Any]:
    r = http.get("/health", timeout=5)
    assert r.status_code == 200, r.text
    return r.json()


def wait_idle(http: httpx.Client, timeout: float = 10.0) -> dict[str, Any]:
    """Wait until the worker runs nothing and has nothing queued; return that /health body."""
    deadline = time.monotonic() + timeout
    while True:
        h = health(http)
        if h["running"] == 0 and h["queued"] == 0:
            return h
        assert time.monotonic() < deadline, f"worker still busy after {timeout}s: {h}"
        time.sleep(0.05)


def assert_generation_stopped(http: httpx.Client, before: int, within: float = 2.0) -> int:
    """Within `within` s the worker is idle and its token count stops growing; returns the tokens generated."""
    wait_idle(http, timeout=within)
    first = health(http)["generated_tokens"]
    time.sleep(1.0)
    second = health(http)
    assert second["generated_tokens"] == first, f"tokens still being generated: {first} -> {second}"
    assert second["running"] == 0
    return first - before


def test_health_when_ready(http: httpx.Client) -> None:
    r = http.get("/health")
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "ok" and body["model"] == MODEL
    for key in ("running", "queued", "generated_tokens"):
        assert isinstance(body[key], int) and body[key] >= 0, body


def test_health_is_503_while_loading(tmp_path: Path) -> None:
    """A second server with the slower model: the first answers are 503, /v1/models too (envelope and
    Retry-After), then 200 once loaded."""
    srv = helpers.start_server(tmp_path, "--model", "gemma3-270m", wait=False)
    try:
        answers: list[int] = []
        models_while_loading = None
        deadline = time.monotonic() + helpers.STARTUP_TIMEOUT_S
        with httpx.Client(base_url=srv.base_url, timeout=5) as c:
            while time.monotonic() < deadline:
                assert srv.process.poll() is None, srv.log()
                try:
                    r = c.get("/health")
                except httpx.TransportError:  # not listening yet
                    time.sleep(0.05)
                    continue
                answers.append(r.status_code)
                if r.status_code == 200:
                    break
                assert r.status_code == 503, r.text
                assert r.json() == {"status": "loading"}, r.text
                assert r.headers.get("retry-after", "").isdigit(), r.headers
                if models_while_loading is None:
                    models_while_loading = c.get("/v1/models")
                time.sleep(0.05)
            assert answers and answers[-1] == 200, f"never ready: {answers}\n{srv.log()}"
            assert answers[0] == 503, f"the first answer was not 'loading': {answers}"
            assert models_while_loading is not None
            r = models_while_loading
            assert r.status_code == 503, r.text
            assert r.headers.get("retry-after", "").isdigit(), r.headers
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["code"] == "model_loading" and "loading" in error["message"]
            # Once ready, the same routes serve.
            assert c.get("/health").json()["model"] == "gemma3-270m"
            assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["gemma3-270m"]
    finally:
        helpers.stop_server(srv)
    assert srv.process.returncode is not None


def test_sigterm_while_loading_exits_0(tmp_path: Path) -> None:
    """Stopped while the model loads (a container stopped at once, Ctrl-C): the load ends, the workers it started
    stop, and the process exits 0. Exiting under the loader's torch code aborted (std::terminate, exit 134)."""
    srv = helpers.start_server(tmp_path, "--model", MODEL, wait=False)
    try:
        deadline = time.monotonic() + helpers.STARTUP_TIMEOUT_S
        while True:
            assert srv.process.poll() is None, srv.log()
            assert time.monotonic() < deadline, f"never answered 'loading':\n{srv.log()}"
            try:
                r = httpx.get(f"{srv.base_url}/health", timeout=5)
            except httpx.TransportError:  # not listening yet
                time.sleep(0.05)
                continue
            assert r.status_code == 503, f"loaded before the signal could be sent: {r.text}"
            break
        srv.process.terminate()
        assert srv.process.wait(timeout=60) == 0, srv.log()
        assert "terminate called" not in srv.log()
    finally:
        if srv.process.poll() is None:
            srv.process.kill()
            srv.process.wait()


def test_stream_disconnect_cancels_generation(base_url: str, http: httpx.Client) -> None:
    before = wait_idle(http)["generated_tokens"]
    with httpx.Client(base_url=base_url, timeout=30) as c:
        with c.stream("POST", "/v1/chat/completions", json={**LONG, "stream": True}) as r:
            assert r.status_code == 200
            events = 0
            for line in r.iter_lines():
                events += line.startswith("data:")
                if events >= 4:
                    break
        assert health(http)["generated_tokens"] > before  # it really was generating
    generated = assert_generation_stopped(http, before)
    assert 3 <= generated < 300, generated


def test_non_streaming_client_timeout_cancels_generation(base_url: str, http: httpx.Client) -> None:
    before = wait_idle(http)["generated_tokens"]
    started = time.monotonic()
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{base_url}/v1/chat/completions", json=LONG, timeout=1.5)
    assert time.monotonic() - started < 5
    generated = assert_generation_stopped(http, before)
    assert 1 <= generated < 500, generated


def test_non_streaming_openai_client_timeout_cancels_generation(base_url: str, http: httpx.Client) -> None:
    before = wait_idle(http)["generated_tokens"]
    impatient = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=1.5)
    with pytest.raises(openai.APITimeoutError):
        impatient.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=2000,
                                     extra_body={"ignore_eos": True})
    generated = assert_generation_stopped(http, before)
    assert 1 <= generated < 500, generated


def test_serves_normally_after_cancellations(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                         temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 5 and out.choices[0].finish_reason == "length"


def test_event_loop_stays_responsive_during_generation(base_url: str, http: httpx.Client) -> None:
    """The model runs on the worker thread: /health and /v1/models answer quickly while it generates."""
    wait_idle(http)
    stop = threading.Event()
    received = []

    def generate() -> None:
        body = {**LONG, "max_tokens": 300, "stream": True}
        with httpx.Client(base_url=base_url, timeout=60) as c, c.stream("POST", "/v1/chat/completions",
                                                                         json=body) as r:
            for line in r.iter_lines():
                received.append(line)
                if stop.is_set():
                    break

    thread = threading.Thread(target=generate, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while health(http)["running"] != 1:
            assert time.monotonic() < deadline, "the generation never started"
            time.sleep(0.02)
        tokens_at_start = health(http)["generated_tokens"]
        for _ in range(6):
            for path in ("/health", "/v1/models"):
                started = time.monotonic()
                r = http.get(path, timeout=5)
                elapsed = time.monotonic() - started
                assert r.status_code == 200, r.text
                assert elapsed < 0.5, f"{path} took {elapsed:.2f}s while generating"
            time.sleep(0.1)
        h = health(http)
        assert h["running"] == 1 and h["generated_tokens"] > tokens_at_start, h  # it was generating throughout
    finally:
        stop.set()
        thread.join(30)
    assert not thread.is_alive()
    wait_idle(http, timeout=5)


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "server", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


@pytest.mark.parametrize("model", ["/nonexistent.gguf", "not-a-model"])
def test_missing_model_exits_with_a_clear_message(model: str) -> None:
    p = run_cli("serve", "--model", model, "--port", str(helpers.free_port()))
    assert p.returncode != 0, p
    assert model in p.stderr and "error" in p.stderr.lower(), p.stderr
    assert "Traceback" not in p.stderr + p.stdout, p.stderr


def test_unloadable_model_file_exits_with_a_clear_message(tmp_path: Path) -> None:
    """A file that exists but is not a model fails while loading: the server stops and says why."""
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"this is not a gguf file" * 10)
    p = run_cli("serve", "--model", str(bad), "--port", str(helpers.free_port()))
    assert p.returncode != 0, p
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("error:") and "broken.gguf" in last, p.stderr
    assert "Traceback" not in p.stderr + p.stdout, p.stderr


def test_serve_help() -> None:
    p = run_cli("serve", "--help", timeout=30)
    assert p.returncode == 0, p.stderr
    for option in ("--model", "--host", "--port", "--max-model-len", "--max-context", "--served-model-name"):
        assert option in p.stdout


def test_emberserve_console_script() -> None:
    script = Path(sys.executable).parent / "emberserve"
    assert script.exists(), f"{script} missing: reinstall with `pip install -e .`"
    p = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    assert "serve" in p.stdout


def test_version_flag() -> None:
    from server import __version__

    p = run_cli("--version", timeout=30)
    assert p.returncode == 0 and p.stdout.strip() == f"emberserve {__version__}", (p.stdout, p.stderr)


def test_a_taken_port_ends_the_start_at_once_with_one_line() -> None:
    """Before the model loads (which took the whole load before it failed): its own exit status, one line."""
    import socket

    from server.launch.checks import EXIT_PORT_IN_USE

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        p = run_cli("serve", "--port", str(port), timeout=60)
        elapsed = time.monotonic() - started
    assert p.returncode == EXIT_PORT_IN_USE, (p.returncode, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot listen on 127.0.0.1:") and str(port) in lines[0], \
        p.stderr
    assert "loading" not in p.stderr and elapsed < 20, (elapsed, p.stderr)


def test_start_up_log_says_which_device_auto_chose(server: helpers.ServerProcess) -> None:
    import torch

    found = "a CUDA GPU is present" if torch.cuda.is_available() else "no CUDA GPU found"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert f"on {device} (--device auto: {found})" in server.log()
