"""The first-party import graph: every import of engine/, models/ and pallas_kernels/ (module level and inside
functions) read from the source, held to the layers BUILD declares (scripts/gen_build.py's LAYERS). No cycle,
no import of a layer a file's library does not build on, and no JAX in the scheduler's core."""

import ast
import os

from helpers.build_file import read_build
from helpers.repo import ROOT

PACKAGES = ("engine", "models", "pallas_kernels")


def _modules() -> dict[str, str]:
    """Module name -> its file (relative to the root), for every first-party module."""
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            name = rel.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
            out[name] = rel
    return out


def _imports(path: str, modules: dict[str, str]) -> set[str]:
    """The first-party modules a file imports, anywhere in it (`from pkg import mod` names the module)."""
    tree = ast.parse((ROOT / path).read_text(), path)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def _graph() -> tuple[dict[str, set[str]], dict[str, str]]:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        # A module's package __init__ runs first, but it holds no imports of its own: an edge to it is no import.
        graph[name] = {m for m in _imports(path, modules) if m != name and not name.startswith(m + ".")}
    return graph, modules


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    graph, _ = _graph()
    assert sum(len(targets) for targets in graph.values()) > 100, "the import graph came out (nearly) empty"
    cycles = _cycles(graph)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def _libraries() -> tuple[dict[str, str], dict[str, set[str]]]:
    """file -> its library, and library -> the libraries it may import (its deps, transitively, and itself)."""
    rules = [(name, srcs, deps) for kind, name, srcs, deps in read_build() if kind == "py_library"]
    library_of = {src: name for name, srcs, _ in rules for src in srcs}
    deps = {name: {d.lstrip(":") for d in ds} for name, _, ds in rules}
    allowed = {}
    for name in deps:
        seen, todo = {name}, list(deps[name])
        while todo:
            d = todo.pop()
            if d not in seen:
                seen.add(d)
                todo.extend(deps[d])
        allowed[name] = seen
    return library_of, allowed


def test_every_import_stays_within_the_layers_build_declares():
    graph, modules = _graph()
    library_of, allowed = _libraries()
    # The layers mean something: the scheduler's core builds on no worker, the engine on no front end
    assert "engine_worker" not in allowed["engine_core"] and "engine_entrypoints" not in allowed["engine"]
    wrong = []
    for name, targets in graph.items():
        mine = library_of[modules[name]]
        wrong += [f"{modules[name]} ({mine}) imports {modules[t]} ({library_of[modules[t]]})"
                  for t in sorted(targets) if library_of[modules[t]] not in allowed[mine]]
    assert not wrong, "imports across the layers:\n" + "\n".join(wrong)


def test_the_scheduler_core_imports_no_jax():
    """engine/core decides on host data alone: it must import no JAX (or Flax), anywhere in a module."""
    for path in sorted((ROOT / "engine" / "core").glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        names |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        jax_like = sorted(n for n in names if n.split(".")[0] in ("jax", "jaxlib", "flax"))
        assert not jax_like, f"{os.path.relpath(path, ROOT)} imports {jax_like}"
