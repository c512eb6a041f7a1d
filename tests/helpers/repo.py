"""The repository's root, for tests that run its scripts and command lines or read its files."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
