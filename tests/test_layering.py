"""k3's import graph, read from the source: which subpackages and modules import which, and the circles in it.
Every `import k3...` counts, at the top of a file, inside a function (a lazy import is a dependency at run
time) or under `if TYPE_CHECKING:` (a class the annotations name is a dependency of the reader's).

A `__main__` module is a program (`python -m k3.train` runs the CLI on a torchrun rank), which nothing
imports: it is left out. `python tests/test_layering.py` prints the package graph and every circle.
"""

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC / "k3").with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts) or "k3"


def _imports(tree: ast.AST, package: str) -> set[str]:
    """The k3 modules a file imports (names below k3: `train.tokenizer`)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update(a.name[3:] for a in node.names if a.name.startswith("k3."))
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolved against the file's package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
                if not module.startswith("k3."):
                    return
                module = module[3:]
            found.add(module)
            found.update(f"{module}.{a.name}" for a in node.names)  # `from k3.train import trainer`
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def module_graph() -> dict[str, set[str]]:
    """module -> the k3 modules it imports (names below k3: `serve.llm`, `config`)."""
    files = {_module_name(p): p for p in sorted((SRC / "k3").rglob("*.py")) if p.name != "__main__.py"}
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        graph[name] = {m for m in _imports(ast.parse(path.read_text(encoding="utf-8")), package) if m in files}
        graph[name].discard(name)
    return graph


def package_graph() -> dict[str, set[str]]:
    """subpackage (or top-level module: config, eval) -> the others it imports."""
    graph: dict[str, set[str]] = {}
    for module, targets in module_graph().items():
        top = module.split(".")[0]
        graph.setdefault(top, set()).update(t.split(".")[0] for t in targets)
        graph[top].discard(top)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one node (Tarjan): each a circle of imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph.get(node, ()):
            if other not in index:
                connect(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(component)

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def test_no_circles_between_subpackages():
    """None: hub <-> train went with k3.formats, serve <-> spec and model <-> quant with the serving side."""
    assert [sorted(c) for c in cycles(package_graph())] == []


def test_no_circles_between_modules():
    """None: chat/tokens <-> train/tokenizer and cli/parser <-> cli/training went with this restructuring."""
    assert [sorted(c) for c in cycles(module_graph())] == []


def test_formats_stand_below_their_users():
    """k3.formats (tokenizer, atomic files, checkpoints, run folders) imports only what a checkpoint needs: the
    config and the model's tensor names. hub, serve and chat read through it and import nothing of train;
    demo and distill take from train only what is training's own (the balancer, the optimiser, the corpus)."""
    packages = package_graph()
    assert packages["formats"] <= {"config", "model"}, packages["formats"]
    for user in ("hub", "serve", "spec", "chat", "eval"):
        assert "train" not in packages[user], (user, packages[user])
    modules = module_graph()
    used = {t for m, targets in modules.items() if m.startswith(("demo.", "distill.")) for t in targets}
    assert {t for t in used if t.startswith("train.")} <= {
        "train.balance",
        "train.optim",
        "train.corpus",
        "train.trainer",
    }


def test_the_checker_sees_deferred_imports_and_circles():
    """The checker itself: an import inside a function or under TYPE_CHECKING is an edge, and a circle of two
    modules is found (one that only leads into it is not part of it)."""
    tree = ast.parse("def f():\n    from k3.b import g\n\nif TYPE_CHECKING:\n    import k3.c\n")
    assert _imports(tree, "a") == {"b", "b.g", "c"}
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [{"a", "b"}]


def test_serving_a_run_folder_loads_no_training_module(tmp_path):
    """LLM(model=RUN) reads the checkpoint and tokenizer through k3.formats: no k3.train module is imported."""
    from k3.cli import main

    assert main(["init", "--preset", "tiny", "--out", str(tmp_path / "run")]) == 0
    script = (
        "import sys\n"
        "import k3.serve.llm\n"
        f"llm = k3.serve.llm.LLM(model={str(tmp_path / 'run')!r}, memory_budget=4 << 20)\n"
        "llm.close()\n"
        "print(sorted(m for m in sys.modules if m.startswith('k3.train')))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


if __name__ == "__main__":
    packages = package_graph()
    for name in sorted(packages):
        print(f"{name:10} -> {', '.join(sorted(packages[name])) or '-'}")
    print("\npackage circles:", [sorted(c) for c in cycles(packages)] or "none")
    print("module circles: ", [sorted(c) for c in cycles(module_graph())] or "none")
