"""BUILD lists every source file: a new module or test that is not declared there fails here."""

import glob
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("engine", "models", "pallas_kernels")


def _read_build():
    rules = []

    def rule(kind):
        def record(name, srcs=(), deps=(), data=(), **_):
            rules.append((kind, name, list(srcs), list(deps)))
        return record

    namespace = {k: rule(k) for k in ("py_library", "py_test", "py_binary")}
    with open(os.path.join(ROOT, "BUILD")) as f:
        exec(compile(f.read(), "BUILD", "exec"), namespace)  # BUILD is Starlark, a Python subset
    return rules


def _sources(pattern):
    return {os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern), recursive=True)}


def test_every_source_file_is_declared():
    rules = _read_build()
    listed = {src for _, _, srcs, _ in rules for src in srcs}
    on_disk = set().union(*(_sources(f"{pkg}/**/*.py") for pkg in PACKAGES), _sources("tests/*.py"),
                          _sources("scripts/*.py"))
    assert not on_disk - listed, f"missing from BUILD: {sorted(on_disk - listed)}"
    assert not listed - on_disk, f"BUILD lists files that do not exist: {sorted(listed - on_disk)}"


def test_one_library_per_package_and_one_test_per_test_file():
    rules = _read_build()
    libraries = {name: srcs for kind, name, srcs, _ in rules if kind == "py_library"}
    for pkg in PACKAGES:
        assert pkg in libraries and all(s.startswith(pkg + "/") for s in libraries[pkg])
    tests = {srcs[0] for kind, _, srcs, _ in rules if kind == "py_test"}
    assert tests == _sources("tests/test_*.py")
    names = [name for _, name, _, _ in rules]
    assert len(names) == len(set(names)), "rule names must be unique"
    for _, name, _, deps in rules:
        for dep in deps:
            assert dep.lstrip(":") in names, f"{name} depends on unknown rule {dep}"
