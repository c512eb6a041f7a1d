# Two entry points: `make test` (fresh environment + the test suite) and `make serve` (arrives with the server issue).
PYTHON ?= python3
VENV ?= .venv

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e ".[test]"
	touch $@

.PHONY: test
test: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -q tests
