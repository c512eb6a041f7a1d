"""BUILD lists every source file: a new module or test that is not declared there fails here."""

import glob
import os

from helpers.build_file import read_build
from helpers.repo import ROOT as REPO_ROOT

ROOT = str(REPO_ROOT)
PACKAGES = ("engine", "models", "pallas_kernels")


def _sources(pattern):
    return {os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern), recursive=True)}


def test_every_source_file_is_declared():
    rules = read_build()
    listed = {src for _, _, srcs, _ in rules for src in srcs}
    on_disk = set().union(*(_sources(f"{pkg}/**/*.py") for pkg in PACKAGES), _sources("tests/**/*.py"),
                          _sources("scripts/*.py"))
    assert not on_disk - listed, f"missing from BUILD: {sorted(on_disk - listed)}"
    assert not listed - on_disk, f"BUILD lists files that do not exist: {sorted(listed - on_disk)}"


def test_one_library_per_layer_and_one_test_per_test_file():
    rules = read_build()
    libraries = {name: srcs for kind, name, srcs, _ in rules if kind == "py_library"}
    for pkg in PACKAGES:  # every package's libraries hold its files alone
        assert pkg in libraries and all(s.startswith(pkg + "/") for s in libraries[pkg])
    assert all(s.startswith("engine/core/") for s in libraries["engine_core"])
    assert all(s.startswith("engine/worker/") for s in libraries["engine_worker"])
    tests = {srcs[0] for kind, _, srcs, _ in rules if kind == "py_test"}
    assert tests == _sources("tests/**/test_*.py")
    names = [name for _, name, _, _ in rules]
    assert len(names) == len(set(names)), "rule names must be unique"
    for _, name, _, deps in rules:
        for dep in deps:
            assert dep.lstrip(":") in names, f"{name} depends on unknown rule {dep}"
