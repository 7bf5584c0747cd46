"""Domains of training text: the embedded corpus split three ways, plus synthetic reasoning tasks at two
levels of effort. Specialist teachers are fine-tuned one per domain (`k3 train --data DOMAIN`) and merged
into one student by on-policy distillation (`k3 distill`, docs/distillation.md).

    code             the library's Python source (test files excluded) with its docstrings and comments removed
    tests            the test files (any file under a test/, tests/ or idle_test/ folder, or named test_*.py)
    docs             the docstrings and comments of the library files, in source order
    reasoning-low    arithmetic tasks answered at once:            "Task (low effort): 7 + 5 - 3\\nAnswer: 9\\n"
    reasoning-high   the same tasks, each step worked before the answer ("Step: 7 + 5 = 12\\n..." then "Answer: 9")

Effort is the number of worked intermediate steps before the answer: none at low effort, one per
operation at high effort. Tasks are a pure function of their index, so every machine makes the same
ones, and every answer is checkable (`check_answer`).

A document keeps the name of the file (or task) it came from in every domain, so the corpus' split of
training and validation by a hash of names (k3.train.corpus) puts a file's code and its docstrings on the
same side, and task i on the same side at both efforts. Domains join with "+" (`code+tests`).

Nothing here reads files: `domain_documents` takes the corpus' (name, text) pairs.
"""

import ast
import functools
import io
import random
import re
import tokenize
from dataclasses import dataclass
from pathlib import PurePosixPath

CORPUS_DOMAINS = ("code", "tests", "docs")
EFFORTS = ("low", "high")
REASONING_DOMAINS = tuple(f"reasoning-{e}" for e in EFFORTS)
DOMAINS = (*CORPUS_DOMAINS, *REASONING_DOMAINS)
NUM_TASKS = 20_000  # tasks per effort level (about 0.3M tokens at low effort, 0.8M at high)
TEST_FOLDERS = frozenset({"test", "tests", "idle_test"})
ANSWER = re.compile(r"Answer: (-?\d+)")


class DomainError(ValueError):
    """A domain name k3 does not know, or a corpus that leaves a domain empty."""


def parse_domains(spec: str) -> tuple[str, ...]:
    """'code+tests' -> ('code', 'tests'); an unknown or repeated name is a DomainError naming the choices."""
    names = tuple(spec.split("+"))
    for name in names:
        if name not in DOMAINS:
            raise DomainError(f"{name!r} is not a domain; the domains are {', '.join(DOMAINS)} (join with '+')")
    if len(set(names)) != len(names):
        raise DomainError(f"{spec!r} names a domain twice")
    return names


def is_domain_spec(spec: str) -> bool:
    """Whether `spec` is a domain or domains joined with '+' (without checking the file system)."""
    return bool(spec) and all(name in DOMAINS for name in spec.split("+"))


def is_test_file(name: str) -> bool:
    path = PurePosixPath(name)
    return bool(TEST_FOLDERS & set(path.parts[:-1])) or path.name.startswith("test_")


@dataclass(frozen=True)
class Task:
    """A chain of additions and subtractions of one-digit numbers, its running value kept in 0..99."""

    index: int
    start: int
    ops: tuple[tuple[str, int], ...]  # ("+" or "-", operand)

    @property
    def question(self) -> str:
        return " ".join([str(self.start), *(f"{op} {n}" for op, n in self.ops)])

    def values(self) -> list[int]:
        """The running value after each operation."""
        out, value = [], self.start
        for op, n in self.ops:
            value = value + n if op == "+" else value - n
            out.append(value)
        return out

    @property
    def answer(self) -> int:
        return self.values()[-1]

    def prompt(self, effort: str) -> str:
        if effort not in EFFORTS:
            raise DomainError(f"effort {effort!r}: one of {', '.join(EFFORTS)}")
        return f"Task ({effort} effort): {self.question}\n"

    def worked(self, effort: str) -> str:
        """What follows the prompt: the steps (high effort only), then the answer line."""
        steps = []
        if effort == "high":
            before = [self.start, *self.values()[:-1]]
            pairs = zip(before, self.ops, self.values(), strict=True)
            steps = [f"Step: {a} {op} {n} = {v}\n" for a, (op, n), v in pairs]
        return "".join(steps) + f"Answer: {self.answer}\n"

    def text(self, effort: str) -> str:
        return self.prompt(effort) + self.worked(effort)


def make_task(index: int) -> Task:
    """Task `index`: 2 to 4 operations on numbers 1..9, the same on every machine (a string-seeded
    random.Random is independent of PYTHONHASHSEED)."""
    rng = random.Random(f"k3-task-{index}")
    start, value, ops = rng.randint(1, 9), 0, []
    value = start
    for _ in range(rng.randint(2, 4)):
        n = rng.randint(1, 9)
        op = "-" if value - n >= 0 and rng.random() < 0.5 else "+"
        value = value + n if op == "+" else value - n
        ops.append((op, n))
    return Task(index, start, tuple(ops))


def task_name(index: int) -> str:
    return f"task/{index:05d}"


def task_of(name: str) -> Task:
    """The task a reasoning document was made from, by its name."""
    if not name.startswith("task/"):
        raise DomainError(f"{name!r} is not a task document's name (task/NNNNN)")
    return make_task(int(name.split("/", 1)[1].split(":", 1)[0]))


def check_answer(task: Task, completion: str) -> bool:
    """Whether the first 'Answer: N' line of a completion gives the task's answer."""
    found = ANSWER.search(completion)
    return found is not None and int(found.group(1)) == task.answer


@functools.lru_cache(maxsize=4096)  # the code and docs domains cut the same files: parse each once
def split_source(text: str) -> tuple[str, str] | None:
    """(code without docstrings and comments, the docstrings and comments) of Python source; None when it
    does not parse (a few stdlib files are deliberately broken or Python 2)."""
    try:
        tree = ast.parse(text)
        comments = [t for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type == tokenize.COMMENT]
    except (SyntaxError, ValueError, tokenize.TokenError, RecursionError):
        return None
    lines = text.splitlines()
    drop: set[int] = set()  # 0-based lines removed from the code
    pieces: list[tuple[int, str]] = []  # (line, text) of each docstring and comment, for source order
    replace: dict[int, str] = {}  # a body that was only a docstring keeps a statement: "..."
    for node in ast.walk(tree):
        if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        first = node.body[0] if node.body else None
        if not (
            isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)
        ):
            continue
        start, end = first.lineno - 1, first.end_lineno - 1
        pieces.append((start, ast.get_docstring(node, clean=True) or ""))
        if lines[start][: first.col_offset].strip() or lines[end][first.end_col_offset :].strip():
            continue  # shares its lines with other code: kept in the code as it is
        drop.update(range(start, end + 1))
        if len(node.body) == 1 and not isinstance(node, ast.Module):
            replace[start] = " " * first.col_offset + "..."
    cut: dict[int, int] = {}
    for tok in comments:
        row, col = tok.start[0] - 1, tok.start[1]
        pieces.append((row, tok.string.lstrip("#").strip()))
        if lines[row][:col].strip():
            cut[row] = col
        else:
            drop.add(row)
    code = []
    for i, line in enumerate(lines):
        if i in replace:
            code.append(replace[i])
        elif i not in drop:
            code.append(line[: cut[i]].rstrip() if i in cut else line)
    code_text = re.sub(r"\n{3,}", "\n\n", "\n".join(code)).strip("\n")
    docs_text = "\n".join(text for _, text in sorted(pieces, key=lambda p: p[0]) if text)
    return (code_text + "\n" if code_text else ""), (docs_text + "\n" if docs_text else "")


def domain_documents(spec: str, corpus: list[tuple[str, str]] | None = None) -> list[tuple[str, str]]:
    """(name, text) documents of a domain or of domains joined with '+'. corpus: the (name, text) files
    the corpus domains are cut from (the reasoning domains need none)."""
    out: list[tuple[str, str]] = []
    for domain in parse_domains(spec):
        if domain in REASONING_DOMAINS:
            effort = domain.split("-", 1)[1]
            out += [(task_name(i), make_task(i).text(effort)) for i in range(NUM_TASKS)]
            continue
        if corpus is None:
            raise DomainError(f"the {domain} domain is cut from a corpus; none was given")
        found = []
        for name, text in corpus:
            if domain == "tests":
                if is_test_file(name):
                    found.append((name, text))
                continue
            if is_test_file(name) or not name.endswith(".py"):
                continue
            parts = split_source(text)
            piece = None if parts is None else parts[0 if domain == "code" else 1]
            if piece:
                found.append((name, piece))
        if not found:
            raise DomainError(f"the corpus holds no text of the {domain} domain ({len(corpus)} files)")
        out += found
    return out
