"""The trainer end to end through the command line: exact resume after SIGKILL, init, generate, plot,
quickstart, and readable errors."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from k3.cli import main
from k3.train.checkpoint import CheckpointError

TRAIN = ["--preset", "tiny", "--batch-size", "2", "--seq-len", "32", "--vocab-size", "400", "--eval-every", "4",
         "--eval-batches", "2", "--warmup", "2", "--no-progress"]  # fmt: skip


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A few hundred small 'source files', enough for a tokenizer and some sequences."""
    root = tmp_path_factory.mktemp("corpus")
    for i in range(120):
        body = "".join(f"    value_{j} = compute({i}, {j}) + offset_{i % 7}\n" for j in range(i % 9 + 3))
        (root / f"module_{i:03d}.py").write_text(f"def function_{i}(x):\n{body}    return x\n")
    return root


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def k3(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "k3.cli", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_resume_after_sigkill_reproduces_the_unbroken_run(tmp_path, corpus):
    steps = ["--steps", "14", "--ckpt-every", "2", "--data", str(corpus)]
    unbroken = tmp_path / "unbroken"
    assert main(["train", *TRAIN, *steps, "--out", str(unbroken)]) == 0

    broken = tmp_path / "broken"
    proc = k3("train", *TRAIN, *steps, "--out", str(broken))
    deadline = time.time() + 120
    while not (broken / "step_00000004" / "meta.json").exists():
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.time() < deadline
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = max(losses(broken))
    assert killed_at < 14, "the run finished before it could be killed"

    assert main(["train", *TRAIN, *steps, "--out", str(broken), "--resume"]) == 0
    assert losses(broken) == losses(unbroken)  # every step's loss, bitwise (JSON keeps all float digits)


def test_resume_refuses_a_different_config_and_a_fresh_run_refuses_old_checkpoints(tmp_path, corpus, capsys):
    run = tmp_path / "run"
    assert main(["train", *TRAIN, "--steps", "2", "--data", str(corpus), "--out", str(run)]) == 0
    assert main(["train", *TRAIN, "--steps", "2", "--data", str(corpus), "--out", str(run)]) == 2
    assert "already holds checkpoints" in capsys.readouterr().err
    other = [a if a != "tiny" else "small" for a in TRAIN]
    assert main(["train", *other, "--steps", "4", "--data", str(corpus), "--out", str(run), "--resume"]) == 2
    assert "trained with another configuration" in capsys.readouterr().err
    assert main(["train", *TRAIN, "--steps", "4", "--out", str(tmp_path / "none"), "--resume"]) == 2
    assert "no checkpoint to resume" in capsys.readouterr().err
    assert main(["train", *TRAIN, "--steps", "0", "--out", str(tmp_path / "x")]) == 2
    assert "--steps must be at least 1" in capsys.readouterr().err


def test_resume_keeps_the_config_its_run_recorded_when_k3s_defaults_changed(tmp_path, corpus, monkeypatch):
    """A run started when the tiny preset said rms_norm_eps=1e-6 (k3's old default) resumes under 1e-6 now
    that the preset says 1e-5, and its next step's loss is the one the unbroken 1e-6 run computed."""
    import shutil

    from k3.config import PRESETS
    from k3.train.tokenizer import byte_tokenizer
    from k3.train.trainer import TrainArgs, Trainer

    def args(out: Path, **kw) -> TrainArgs:
        return TrainArgs(out=str(out), preset="tiny", steps=3, ckpt_every=2, keep_last=5, batch_size=2, seq_len=16,
                         vocab_size=300, eval_every=100, eval_batches=1, warmup=1, data=str(corpus), progress=False,
                         **kw)  # fmt: skip

    with monkeypatch.context() as old_k3:
        old_k3.setitem(PRESETS, "tiny", {**PRESETS["tiny"], "rms_norm_eps": 1e-6})
        unbroken = tmp_path / "unbroken"
        Trainer(args(unbroken), log=lambda *a: None).train()  # checkpoints at steps 2 and 3
    assert json.loads((unbroken / "step_00000002" / "meta.json").read_text())["config"]["text_config"][
        "rms_norm_eps"] == 1e-6  # fmt: skip
    run = tmp_path / "run"
    shutil.copytree(unbroken, run)
    shutil.rmtree(run / "step_00000003")  # as if the old run had stopped after step 2

    logged = []
    trainer = Trainer(args(run, resume=True), log=logged.append)
    assert trainer.config.rms_norm_eps == 1e-6 and trainer.step == 2
    assert any("rms_norm_eps: 1e-06 != 1e-05" in line and "recorded" in line for line in logged)
    trainer.train()
    assert losses(run)[3] == losses(unbroken)[3]  # bitwise
    assert json.loads((run / "step_00000003" / "meta.json").read_text())["config"]["text_config"][
        "rms_norm_eps"] == 1e-6  # fmt: skip

    # the same preset with a replaced tokenizer cannot fit the recorded vocabulary
    tokenizer = (run / "tokenizer.json").read_bytes()
    byte_tokenizer().save(run / "tokenizer.json")
    with pytest.raises(CheckpointError, match=r"vocabulary of 300 tokens, the run's tokenizer.json 261"):
        Trainer(args(run, resume=True), log=lambda *a: None)
    (run / "tokenizer.json").write_bytes(tokenizer)
    # a different preset asked for now is still another model: refused, naming the fields
    with pytest.raises(CheckpointError, match=r"trained with another configuration: .*hidden_size: 64 != 256"):
        Trainer(TrainArgs(**{**args(run, resume=True).__dict__, "preset": "small"}), log=lambda *a: None)


def test_init_then_generate(tmp_path, capsys):
    assert main(["init", "--preset", "tiny", "--out", str(tmp_path / "m")]) == 0
    capsys.readouterr()
    assert main(["generate", "--ckpt", str(tmp_path / "m"), "--max-tokens", "5", "--seed", "1", "hello"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("hello") and len(out.encode()) > len("hello")
    assert main(["generate", "--ckpt", str(tmp_path / "nothing"), "x"]) == 2
    assert "no such checkpoint" in capsys.readouterr().err
    assert main(["init", "--preset", "tiny", "--out", str(tmp_path / "m")]) == 2


def test_quickstart_and_plot(tmp_path, corpus, capsys):
    out = tmp_path / "qs"
    args = ["quickstart", *TRAIN, "--steps", "4", "--data", str(corpus), "--out", str(out), "--sample-tokens", "8"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "validation loss:" in text and "def fibonacci(n):" in text and "k3 generate --ckpt" in text
    assert re.search(r"served 7 more requests sharing their first \d+ prompt tokens", text)
    assert "prompt tokens came from the prefix cache" in text and "from the prefix cache (0 resumed" not in text
    for name in ("loss.png", "maxvio.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["plot", str(out)]) == 0
    assert main(["plot", str(tmp_path / "missing")]) == 2
