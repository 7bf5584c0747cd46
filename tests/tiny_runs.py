"""A three-step `k3 train` of the tiny preset on a small made-up corpus, for tests that compare two runs."""

import json
from pathlib import Path


def tiny_train_args(tmp_path: Path) -> list[str]:
    """`k3 train` arguments (without --out) over a corpus of 40 small files written under tmp_path."""
    corpus = tmp_path / "corpus"
    corpus.mkdir(exist_ok=True)
    for i in range(40):
        (corpus / f"m{i}.py").write_text("".join(f"def f_{i}_{j}(x):\n    return x * {j}\n" for j in range(6)))
    return [
        "train",
        "--preset",
        "tiny",
        "--batch-size",
        "2",
        "--seq-len",
        "32",
        "--vocab-size",
        "300",
        "--steps",
        "3",
        "--warmup",
        "1",
        "--eval-every",
        "3",
        "--eval-batches",
        "1",
        "--no-progress",
        "--data",
        str(corpus),
    ]


def logged_losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
