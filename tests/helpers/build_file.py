"""Reading BUILD (Starlark, a Python subset) for the tests that hold the tree to it."""

from helpers.repo import ROOT


def read_build() -> list[tuple[str, str, list[str], list[str]]]:
    """BUILD's rules: (kind, name, srcs, deps)."""
    rules = []

    def rule(kind):
        def record(name, srcs=(), deps=(), data=(), **_):
            rules.append((kind, name, list(srcs), list(deps)))
        return record

    namespace = {k: rule(k) for k in ("py_library", "py_test", "py_binary")}
    with open(ROOT / "BUILD") as f:
        exec(compile(f.read(), "BUILD", "exec"), namespace)  # BUILD is Starlark, a Python subset
    return rules
