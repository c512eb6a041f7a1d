# The two set-up commands of the README: `make serve` (the OpenAI-compatible server on the embedded
# model) and `make test` (the test suite). Each creates the virtual environment it needs first.
PYTHON ?= python3
VENV ?= .venv
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?= models/default
SERVE_FLAGS ?=

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip

$(VENV)/.installed-serve: pyproject.toml setup.py | $(VENV)/bin/python
	$(VENV)/bin/python -m pip install -q -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml setup.py | $(VENV)/bin/python
	$(VENV)/bin/python -m pip install -q -e ".[test]"
	touch $@ $(VENV)/.installed-serve

.PHONY: serve test
serve: $(VENV)/.installed-serve
	$(VENV)/bin/python -m engine.serve --model=$(MODEL) --host=$(HOST) --port=$(PORT) $(SERVE_FLAGS)

test: $(VENV)/.installed-test
	$(VENV)/bin/python -m pytest -q tests
