"""The README stays true: its Python API example runs, and what it says about the Python version, the test
markers and the layout matches pyproject.toml and the tree; it points at nothing outside the repository."""

import re
from pathlib import Path

from k3.cli import main

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
PYPROJECT = (ROOT / "pyproject.toml").read_text(encoding="utf-8")


def test_the_llm_example_runs(tmp_path, capsys):
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    example = next(b for b in blocks if "from k3 import LLM, SamplingParams" in b)
    assert "LLM(model=" in example and ".generate(" in example
    assert main(["init", "--preset", "tiny", "--out", str(tmp_path / "run")]) == 0
    capsys.readouterr()
    exec(example.replace("runs/quickstart", str(tmp_path / "run")), {})
    out = capsys.readouterr().out
    assert out.startswith("def fibonacci(n):\n") and "import os\n" in out and "class Stack:\n" not in out


def test_python_version_and_venv_are_stated():
    (required,) = re.findall(r'requires-python = "(>=[\d.]+)"', PYPROJECT)
    assert f"Python {required[2:]} or newer" in README and "python3 -m venv .venv" in README


def test_markers_are_those_pyproject_declares():
    declared = set(re.findall(r'^\s+"(\w+): ', PYPROJECT, flags=re.M))
    assert declared == {"slow", "cuda"}
    layout = README[README.index("## Layout") :]
    assert all(f"`{m}`" in layout for m in declared)
    carried = {m for f in (ROOT / "tests").glob("test_*.py") for m in re.findall(r"pytest\.mark\.(\w+)", f.read_text())}
    # the README may say that no test carries `slow` only while that is true
    assert ("no test carries today" in layout) == ("slow" not in carried)


def test_layout_names_what_exists_and_nothing_outside():
    layout = README[README.index("## Layout") :]
    for name in ["ops", "model", "quant", "hub", "train", "serve", "cli"]:
        assert re.search(rf"`(src/k3/)?{name}`", layout), name
        assert (ROOT / "src/k3" / name).is_dir() or (ROOT / f"src/k3/{name}.py").exists(), name
    assert (ROOT / "src/k3/eval.py").exists() and "`eval.py`" in layout
    for helper in re.findall(r"`(\w+\.py)`", layout):
        assert (ROOT / "tests" / helper).exists() or (ROOT / "src/k3" / helper).exists(), helper
    docs = re.search(r"docs in `docs/` \(([^)]*)\)", layout).group(1).split(",")
    docs = [d.strip() for d in docs]
    assert sorted(docs) == sorted(p.stem for p in (ROOT / "docs").glob("*.md"))
    assert "shared folder" not in README and "STYLE.md" not in README and "SPEC.md" not in README


def test_measured_quotes_the_benchmarks_summary():
    """One source of figures: README's Measured block is docs/benchmarks.md's summary, verbatim."""
    docs = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")

    def block(text: str) -> str:
        return text[text.index("<!-- summary:start -->") : text.index("<!-- summary:end -->")]

    assert block(README) == block(docs) and "tokens/s" in block(docs)
