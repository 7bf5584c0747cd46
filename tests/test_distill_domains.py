"""The domains specialist teachers are trained on (k3.data.domains) and `k3 train --data DOMAIN`."""

import ast
import json

import pytest

from k3.data.domains import (
    DOMAINS,
    NUM_TASKS,
    DomainError,
    check_answer,
    domain_documents,
    is_test_file,
    make_task,
    parse_domains,
    split_source,
    task_name,
    task_of,
)
from k3.train.corpus import domain_spec, load_corpus

SOURCE = '''"""Module docstring."""
# a leading comment
import os  # why os


def f(x):
    """Return x doubled.

    More words.
    """
    return 2 * x  # doubled


class C:
    """Only a docstring."""


def g():
    "one line"; return 1
'''


def test_split_source_separates_code_from_docstrings_and_comments():
    code, docs = split_source(SOURCE)
    # runs of blank lines left by removed lines become one blank line
    assert code == (
        'import os\n\ndef f(x):\n    return 2 * x\n\nclass C:\n    ...\n\ndef g():\n    "one line"; return 1\n'
    )
    ast.parse(code)  # still Python: a body that was only a docstring keeps "..."
    assert docs == (
        "Module docstring.\na leading comment\nwhy os\nReturn x doubled.\n\nMore words.\ndoubled\n"
        "Only a docstring.\none line\n"
    )
    assert split_source("def broken(:\n") is None


def test_test_files_by_folder_or_name():
    assert is_test_file("test/test_os.py") and is_test_file("idlelib/idle_test/htest.py")
    assert is_test_file("test_x.py") and is_test_file("lib2to3/tests/data/bom.py")
    assert not is_test_file("unittest/case.py") and not is_test_file("json/decoder.py")


def test_corpus_domains_partition_the_files():
    corpus = [("json/decoder.py", SOURCE), ("test/test_json.py", "import json\n"), ("README", "text\n")]
    assert domain_documents("tests", corpus) == [("test/test_json.py", "import json\n")]
    code, docs = split_source(SOURCE)
    assert domain_documents("code", corpus) == [("json/decoder.py", code)]
    assert domain_documents("docs", corpus) == [("json/decoder.py", docs)]
    assert domain_documents("code+tests", corpus) == [("json/decoder.py", code), ("test/test_json.py", "import json\n")]
    with pytest.raises(DomainError, match="no text of the tests domain"):
        domain_documents("tests", corpus[:1])


def test_tasks_are_deterministic_and_checkable():
    task = make_task(7)
    assert task == make_task(7) and task != make_task(8)
    values = [task.start]
    for op, n in task.ops:
        values.append(values[-1] + n if op == "+" else values[-1] - n)
    assert task.answer == values[-1] and all(0 <= v <= 99 for v in values) and 2 <= len(task.ops) <= 4
    low, high = task.text("low"), task.text("high")
    assert low == f"Task (low effort): {task.question}\nAnswer: {task.answer}\n"
    steps = high.splitlines()[1:-1]
    assert len(steps) == len(task.ops)  # effort: one worked step per operation
    for line, before, after in zip(steps, values[:-1], values[1:], strict=True):
        assert line.startswith(f"Step: {before} ") and line.endswith(f" = {after}")
    assert high.startswith(task.prompt("high")) and high.endswith(f"Answer: {task.answer}\n")
    assert check_answer(task, f"Step: whatever\nAnswer: {task.answer}\nAnswer: 0")
    assert not check_answer(task, f"Answer: {task.answer + 1}\n") and not check_answer(task, "no answer")
    assert task_of(task_name(7) + ":val") == task
    docs = domain_documents("reasoning-high")
    assert len(docs) == NUM_TASKS and docs[7] == (task_name(7), high)


def test_domain_names():
    assert parse_domains("code+reasoning-low") == ("code", "reasoning-low")
    with pytest.raises(DomainError, match="'maths' is not a domain; the domains are code, tests"):
        parse_domains("code+maths")
    with pytest.raises(DomainError, match="twice"):
        parse_domains("code+code")
    assert domain_spec("tests") == "tests" and domain_spec("./tests") is None and domain_spec(None) is None
    assert set(DOMAINS) == {"code", "tests", "docs", "reasoning-low", "reasoning-high"}


def test_domain_split_keeps_a_task_on_one_side_at_both_efforts():
    low_train, low_val = load_corpus("reasoning-low")
    _, high_val = load_corpus("reasoning-high")
    assert [d.name for d in low_val] == [d.name for d in high_val] and 0 < len(low_val) < len(low_train) / 20
    assert {d.name for d in low_train}.isdisjoint(d.name for d in low_val)


def test_k3_train_data_domain(tmp_path, monkeypatch):
    from k3.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "reasoning-low").mkdir()  # a bare domain name is the domain, whatever folders exist here
    rc = main(
        [
            "train",
            "--preset",
            "tiny",
            "--data",
            "reasoning-low",
            "--vocab-size",
            "300",
            "--steps",
            "1",
            "--batch-size",
            "2",
            "--seq-len",
            "32",
            "--eval-batches",
            "1",
            "--no-progress",
            "--out",
            "run",
        ]
    )
    assert rc == 0
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["data"]["path"] == "reasoning-low"
    assert domain_spec("./reasoning-low") is None  # the folder
