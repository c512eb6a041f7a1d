"""Test-wide settings."""

import gc
import os

import pytest

# No persistent compilation cache in tests: a warm cache would hide a compile-count regression.
os.environ["FERRY_COMPILATION_CACHE"] = "0"
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
# The suite runs on the CPU. Where libtpu is installed (the jax 0.11 environment, for the TPU compile table), jax
# would otherwise try the TPU backend in this process and hold libtpu's one-process lock for its lifetime, and
# scripts/aot_compile.py, run as a child, could not load libtpu (tests/scripts/test_aot_compile.py).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA's CPU backend at LLVM -O0: compiling, not running, is most of this suite's time (tiny models, hundreds of
# programs), and -O0 compiles a step program 2-3x faster. HLO passes, and so each program's ops, shapes,
# collectives and compile count, are the same; only the machine code is less optimised. Set before jax starts,
# and inherited by every child process (scripts, servers, the multi-device drivers, the notebook's kernel).
CPU_COMPILE_FLAG = "--xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {CPU_COMPILE_FLAG}".strip()


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop jax's caches of traced and compiled functions after each test module: the suite runs in one process,
    and hundreds of models' step programs (each model's graph a new static argument) would otherwise stay
    resident to the end (the 16 architectures of the parity tests alone hold gigabytes). Engines and fixtures
    keep the executables they hold."""
    yield
    import jax  # noqa: PLC0415 (after the environment above is set)

    jax.clear_caches()
    gc.collect()
