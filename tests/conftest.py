"""Test-wide settings."""

import os

# No persistent compilation cache in tests: a warm cache would hide a compile-count regression.
os.environ["FERRY_COMPILATION_CACHE"] = "0"
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
