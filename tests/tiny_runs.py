"""Tiny run folders for tests: a three-step `k3 train` of the tiny preset on a small made-up corpus (for tests
that compare two runs), and a `k3 init` run with every tensor carrying signal (make_run)."""

import json
from pathlib import Path

import torch

from k3.cli import main


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


def make_run(path: Path, tokenizer=None) -> Path:
    """A tiny run folder whose AttnRes queries and router bias are random (zero at init: their terms would
    vanish), with `tokenizer` (a K3Tokenizer) in place of k3 init's byte tokenizer when given."""
    args = ["init", "--preset", "tiny", "--out", str(path), "--seed", "3"]
    assert main(args) == 0
    from safetensors.torch import load_file, save_file

    from k3.formats.checkpoint import _sha256, write_meta

    step = path / "step_00000000"
    tensors = load_file(step / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    for name, t in tensors.items():
        if name.endswith(("_res_proj.weight", "e_score_correction_bias")):
            tensors[name] = torch.randn(t.shape, generator=g) * 0.5
    save_file(tensors, step / "model.safetensors", metadata={"format": "pt"})
    meta = json.loads((step / "meta.json").read_text())
    meta["sha256"]["model.safetensors"] = _sha256(step / "model.safetensors")
    write_meta(step, meta)
    if tokenizer is not None:
        for found in path.rglob("tokenizer.json"):
            tokenizer.save(found)
    return path
