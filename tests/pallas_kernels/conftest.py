"""The kernel tests' fixtures."""

import os
import secrets

import pytest

from pallas_kernels.native import library


@pytest.fixture
def seed():
    """A fresh seed per test (FERRY_KERNEL_SEED sets it), printed and in every assertion message."""
    value = int(os.environ.get("FERRY_KERNEL_SEED", secrets.randbits(31)))
    print(f"FERRY_KERNEL_SEED={value}")  # shown by pytest when the test fails
    return value


@pytest.fixture
def native_library():
    """The native library must be there: it is built when the package is installed (setup.py), so the tests
    that use it FAIL, never skip, when it is not."""
    assert library.available(), f"native library unavailable: {library.unavailable_reason()}"
