"""Layering of the model and serving side (issue 27): no import cycle among the files of k3.serve, k3.spec,
k3.model, k3.quant and k3.ops, none between those packages, and spec (the draft model and its training)
importing nothing from serve (the speculative runtime that uses it). Read from the source with `ast`, so a
deferred import inside a function counts as much as one at the top of a file.

`python tests/test_layering_serve.py` prints the package graph and the file edges between packages."""

import ast
import sys
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGES = ("serve", "spec", "model", "quant", "ops")
FORBIDDEN = {("spec", "serve")}  # (importer, imported): the draft model never reaches into the engine


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    """Every module of k3 by dotted name (a package by its __init__)."""
    return {_module_name(p): p for p in sorted((SRC / "k3").rglob("*.py"))}


def _resolve(target: str, names: list[str], known: dict[str, Path]) -> list[str]:
    """`from target import names`: the submodules named, else target itself."""
    subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in known]
    return subs if subs and len(subs) == len(names) else [*subs, target] if target in known else subs


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The k3 modules `name` imports, anywhere in the file (a parent package's __init__ that Python runs on
    the way is not counted: it is no dependency of the file's code)."""
    out: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "k3" and a.name in known}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            if target.split(".")[0] == "k3":
                out |= set(_resolve(target, [a.name for a in node.names], known))
    out.discard(name)
    return out


def package_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in PACKAGES else None


def graph() -> dict[str, set[str]]:
    """File-level import graph of the modules in PACKAGES (edges to modules outside them dropped)."""
    known = modules()
    ours = {n: p for n, p in known.items() if package_of(n) is not None}
    return {n: {m for m in imports(n, p, known) if m in ours} for n, p in ours.items()}


def package_graph(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = defaultdict(set)
    for a, targets in edges.items():
        for b in targets:
            if package_of(a) != package_of(b):
                out[package_of(a)].add(package_of(b))
    return out


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
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
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_between_files():
    assert cycles(graph()) == []


def test_no_import_cycle_between_packages():
    assert cycles(package_graph(graph())) == []


def test_spec_imports_nothing_from_serve():
    edges = graph()
    bad = [(a, b) for a, targets in edges.items() for b in targets if (package_of(a), package_of(b)) in FORBIDDEN]
    assert bad == []


def test_the_check_sees_deferred_imports_and_cycles(tmp_path):
    """The checker itself: an import inside a function is an edge, and a two-file circle is found."""
    (tmp_path / "a.py").write_text("def f():\n    from k3.b import g\n")
    known = {"k3.a": tmp_path / "a.py", "k3.b": tmp_path / "b.py"}
    assert imports("k3.a", known["k3.a"], known) == {"k3.b"}
    assert cycles({"k3.a": {"k3.b"}, "k3.b": {"k3.a"}, "k3.c": {"k3.a"}}) == [["k3.a", "k3.b"]]


if __name__ == "__main__":
    edges = graph()
    for a, targets in sorted(package_graph(edges).items()):
        print(f"{a} -> {', '.join(sorted(targets))}")
    if "-v" in sys.argv:
        for a, targets in sorted(edges.items()):
            for b in sorted(t for t in targets if package_of(t) != package_of(a)):
                print(f"  {a} -> {b}")
    for component in cycles(edges):
        print("file cycle:", " <-> ".join(component))
    for component in cycles(package_graph(edges)):
        print("package cycle:", " <-> ".join(component))
