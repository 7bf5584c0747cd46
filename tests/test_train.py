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
from k3.formats.checkpoint import CheckpointError
from k3.formats.run_record import RunMismatchError

TRAIN = [
    "--preset",
    "tiny",
    "--batch-size",
    "2",
    "--seq-len",
    "32",
    "--vocab-size",
    "400",
    "--eval-every",
    "4",
    "--eval-batches",
    "2",
    "--warmup",
    "2",
    "--no-progress",
]


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
    assert "--preset: the run recorded 'tiny', now 'small'" in capsys.readouterr().err
    assert (
        main(["train", *other, "--steps", "4", "--data", str(corpus), "--out", str(run), "--resume", "--override"]) == 2
    )
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
    from k3.formats.tokenizer import SPECIAL_TOKENS, byte_tokenizer
    from k3.train.trainer import TrainArgs, Trainer

    def args(out: Path, **kw) -> TrainArgs:
        return TrainArgs(
            out=str(out),
            preset="tiny",
            steps=3,
            ckpt_every=2,
            keep_last=5,
            batch_size=2,
            seq_len=16,
            vocab_size=300,
            eval_every=100,
            eval_batches=1,
            warmup=1,
            data=str(corpus),
            progress=False,
            **kw,
        )

    with monkeypatch.context() as old_k3:
        old_k3.setitem(PRESETS, "tiny", {**PRESETS["tiny"], "rms_norm_eps": 1e-6})
        unbroken = tmp_path / "unbroken"
        Trainer(args(unbroken), log=lambda *a: None).train()  # checkpoints at steps 2 and 3
    assert (
        json.loads((unbroken / "step_00000002" / "meta.json").read_text())["config"]["text_config"]["rms_norm_eps"]
        == 1e-6
    )
    run = tmp_path / "run"
    shutil.copytree(unbroken, run)
    shutil.rmtree(run / "step_00000003")  # as if the old run had stopped after step 2

    logged = []
    trainer = Trainer(args(run, resume=True), log=logged.append)
    assert trainer.config.rms_norm_eps == 1e-6 and trainer.step == 2
    assert any("rms_norm_eps: 1e-06 != 1e-05" in line and "recorded" in line for line in logged)
    trainer.train()
    assert losses(run)[3] == losses(unbroken)[3]  # bitwise
    assert (
        json.loads((run / "step_00000003" / "meta.json").read_text())["config"]["text_config"]["rms_norm_eps"] == 1e-6
    )

    # the same preset with a replaced tokenizer cannot fit the recorded vocabulary
    tokenizer = (run / "tokenizer.json").read_bytes()
    byte_tokenizer().save(run / "tokenizer.json")
    with pytest.raises(RunMismatchError, match=r"tokenizer.json: it was replaced after the run started"):
        Trainer(args(run, resume=True), log=lambda *a: None)
    with pytest.raises(
        CheckpointError, match=rf"vocabulary of 300 tokens, the run's tokenizer.json {256 + len(SPECIAL_TOKENS)}"
    ):
        Trainer(args(run, resume=True, override=True), log=lambda *a: None)
    (run / "tokenizer.json").write_bytes(tokenizer)
    # a different preset asked for now is still another model: refused, naming the fields
    with pytest.raises(CheckpointError, match=r"trained with another configuration: .*hidden_size: 64 != 256"):
        Trainer(TrainArgs(**{**args(run, resume=True, override=True).__dict__, "preset": "small"}), log=lambda *a: None)


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
    assert "validation loss:" in text and "def fibonacci(n):" in text and "k3 generate --model" in text
    assert re.search(r"served 7 more requests sharing their first \d+ prompt tokens", text)
    assert "prompt tokens came from the prefix cache" in text and "from the prefix cache (0 resumed" not in text
    for name in ("loss.png", "maxvio.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["plot", str(out)]) == 0
    assert main(["plot", str(tmp_path / "missing")]) == 2


def test_balancer_none_logs_maxvio_and_leaves_the_bias_at_zero(tmp_path, corpus):
    """Without balancing the run still logs MaxVio per MoE layer, so it can be compared with the rules."""
    from k3.formats.checkpoint import load_checkpoint

    run = tmp_path / "none"
    assert main(["train", *TRAIN, "--steps", "2", "--balancer", "none", "--data", str(corpus), "--out", str(run)]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    ckpt = load_checkpoint(run)
    moe_layers = sum(f == "moe" for f in ckpt.config.ffn_types)
    assert [len(r["maxvio"]) for r in records] == [moe_layers] * 2 and moe_layers > 0
    assert all(v > 0 for r in records for v in r["maxvio"])  # an untrained router is not perfectly balanced
    biases = [t for n, t in ckpt.tensors("model.safetensors").items() if n.endswith("e_score_correction_bias")]
    assert biases and all((b == 0).all() for b in biases)


def run_json(run: Path) -> dict:
    return json.loads((run / "run.json").read_text())


def test_a_folder_reused_with_other_data_is_refused_naming_the_difference(tmp_path, corpus, capsys):
    """A run interrupted before its first checkpoint, then `--data OTHER --out SAME`: refused, naming --data
    (no reuse of the first run's tokenizer and tokens); --override starts over on the new data, and the
    metrics log no longer carries the first run's steps."""
    run = tmp_path / "run"
    base = [*TRAIN, "--steps", "2", "--out", str(run)]
    assert main(["train", *base, "--data", str(corpus)]) == 0
    for step in run.glob("step_*"):  # as if killed before its first checkpoint
        import shutil

        shutil.rmtree(step)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 42, "loss": 9.0}\n{"step": 43, "loss": 9.0}\n')
    recorded = run_json(run)
    assert recorded["data"]["path"] == str(corpus.resolve()) and len(recorded["data"]["sha256"]) == 64
    assert recorded["flags"]["lr"] == 3e-3 and len(recorded["tokenizer_sha256"]) == 64
    tokenizer = (run / "tokenizer.json").read_bytes()

    other = tmp_path / "other"
    other.mkdir()
    for i in range(60):
        (other / f"notes_{i}.txt").write_text("".join(f"note {i}.{j}: {j * i} hi {i % 7}\n" for j in range(30)))
    assert main(["train", *base, "--data", str(other)]) == 2
    err = capsys.readouterr().err
    assert f"--data: the run was made from {corpus.resolve()}, now {other.resolve()}" in err and "--override" in err
    assert (run / "tokenizer.json").read_bytes() == tokenizer and run_json(run) == recorded  # nothing touched

    assert main(["train", *base, "--data", str(other), "--override"]) == 0
    assert (run / "tokenizer.json").read_bytes() != tokenizer  # learned again from the new data
    now = run_json(run)
    assert now["data"]["path"] == str(other.resolve()) and now["tokenizer_sha256"] != recorded["tokenizer_sha256"]
    assert now["history"][0]["step"] == 0 and now["history"][0]["override"][0].startswith("--data:")
    from k3.train.plot import read_metrics

    assert [r["step"] for r in read_metrics(run)] == [1, 2]

    # the same path with changed content is a difference too
    (other / "notes_0.txt").write_text("changed\n" * 9)
    assert main(["train", *[*TRAIN, "--steps", "3", "--out", str(run)], "--data", str(other), "--resume"]) == 2
    assert "--data: the files of" in capsys.readouterr().err


def test_resume_with_changed_flags_is_refused_and_override_makes_them_take_effect(tmp_path, corpus, capsys):
    run = tmp_path / "run"
    base = [*TRAIN, "--data", str(corpus), "--out", str(run)]
    assert main(["train", *base, "--steps", "2"]) == 0
    capsys.readouterr()
    changed = ["--lr", "0.001", "--seed", "5", "--seq-len", "16", "--batch-size", "3"]
    assert main(["train", *base, "--steps", "4", "--resume", *changed]) == 2
    err = capsys.readouterr().err
    for item in (
        "--lr: the run recorded 0.003, now 0.001",
        "--seed: the run recorded 0, now 5",
        "--seq-len: the run recorded 32, now 16",
        "--batch-size: the run recorded 2, now 3",
    ):
        assert item in err, item
    assert err.count("\n") == 1  # one line
    assert [r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())] == [1, 2]

    from k3.cli import _train_args, build_parser
    from k3.train.trainer import Trainer

    args = _train_args(build_parser().parse_args(["train", *base, "--steps", "4", "--resume", "--override", *changed]))
    trainer = Trainer(args, log=lambda *a: None)
    assert trainer.train_data.seq_len == 16 and trainer.train_data.seed == 5
    assert {g["base_lr"] for g in trainer.optimizer.param_groups} == {0.001}
    trainer.train()
    records = list(map(json.loads, (run / "metrics.jsonl").read_text().splitlines()))
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[2]["lr"] <= 0.001 < records[1]["lr"]  # the new peak lr scales the schedule from step 3
    recorded = run_json(run)
    assert recorded["flags"]["lr"] == 0.001 and recorded["flags"]["seq_len"] == 16
    assert recorded["history"][0]["step"] == 2 and len(recorded["history"][0]["override"]) == 4
    assert main(["train", *base, "--steps", "4", "--resume", *changed]) == 0  # now these are the run's values
    assert "already finished 4 steps" in capsys.readouterr().out


def test_a_killed_runs_leftovers_are_cleaned_and_a_torn_metrics_line_is_dropped(tmp_path, corpus, capsys):
    run = tmp_path / "run"
    base = [*TRAIN, "--data", str(corpus), "--out", str(run), "--ckpt-every", "2"]
    assert main(["train", *base, "--steps", "2"]) == 0
    (run / ".step_00000004.tmp").mkdir()  # a save killed before its rename, at a step never saved again
    (run / ".step_00000004.tmp" / "model.safetensors").write_bytes(b"partial")
    (run / ".tokenizer.json.tmp").write_bytes(b"{")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "lo')  # a kill mid-append
    from k3.train.plot import read_metrics

    messages = []
    assert [r["step"] for r in read_metrics(run, log=messages.append)] == [1, 2]
    assert messages == [
        f"{run / 'metrics.jsonl'}: dropped a torn last line (line 3, 15 bytes) left by an interrupted write"
    ]
    capsys.readouterr()
    assert main(["train", *base, "--steps", "3", "--resume"]) == 0
    out = capsys.readouterr().out
    assert "removed 2 unfinished writes" in out and ".step_00000004.tmp" in out
    assert f"{run / 'metrics.jsonl'}: dropped a torn last line" in out
    assert not list(run.glob(".*"))
    assert [r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())] == [1, 2, 3]
    assert [p.name for p in run.glob("step_*")] == ["step_00000003"]  # by default only what resume needs


def test_atomic_write_leaves_the_old_file_or_the_new_one(tmp_path):
    from k3.formats.files import atomic_write

    target = tmp_path / "tokenizer.json"
    atomic_write(target, "old")

    def torn(tmp: Path) -> None:
        tmp.write_bytes(b"")  # the 0-byte file a kill during the first write used to leave
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(target, torn)
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["tokenizer.json"]


def test_rerunning_a_finished_quickstart_reports_its_numbers(tmp_path, corpus, capsys):
    out = tmp_path / "qs"
    args = ["quickstart", *TRAIN, "--steps", "2", "--data", str(corpus), "--out", str(out), "--sample-tokens", "2"]
    assert main(args) == 0
    first = re.search(r"validation loss: (\S+) nats/token after 2 steps", capsys.readouterr().out).group(1)
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "already finished 2 steps" in text and "nan" not in text
    assert re.search(r"validation loss: (\S+) nats/token after 2 steps", text).group(1) == first


def test_resume_falls_back_past_a_damaged_newest_checkpoint_and_says_so(tmp_path, corpus, capsys):
    run = tmp_path / "run"
    base = [*TRAIN, "--data", str(corpus), "--out", str(run), "--ckpt-every", "2", "--keep-last", "2"]
    assert main(["train", *base, "--steps", "4"]) == 0
    unbroken = losses(run)
    (run / "step_00000004" / "meta.json").write_text("[]")
    capsys.readouterr()
    assert main(["train", *base, "--steps", "4", "--resume"]) == 0
    out = capsys.readouterr().out
    assert "loading the older step_00000002 (step 2) because" in out and "step_00000004/meta.json: a JSON list" in out
    assert "resumed from" in out and "at step 2" in out
    assert losses(run) == unbroken  # steps 3 and 4 redone, bitwise


def test_muon_dtype_is_recorded_and_kept_on_resume(tmp_path, corpus):
    """--muon-dtype bfloat16 runs Newton-Schulz in bf16 (the optimiser's Muon groups say so, run.json records the
    flag); resuming keeps the groups' value, and another value needs --override."""
    from k3.formats.run_record import RunMismatchError
    from k3.train.trainer import TrainArgs, Trainer

    def args(out: Path, **kw) -> TrainArgs:
        base = dict(preset="tiny", steps=2, batch_size=2, seq_len=16, vocab_size=300, eval_every=100)
        return TrainArgs(out=str(out), eval_batches=1, warmup=1, data=str(corpus), progress=False, **{**base, **kw})

    run = tmp_path / "bf16"
    trainer = Trainer(args(run, muon_dtype="bfloat16"), log=lambda *a: None)
    trainer.train()
    muon_groups = [g for g in trainer.optimizer.param_groups if g["algo"] == "muon"]
    assert muon_groups and all(g["ns_dtype"] == "bfloat16" for g in muon_groups)
    assert json.loads((run / "run.json").read_text())["flags"]["muon_dtype"] == "bfloat16"
    resumed = Trainer(args(run, muon_dtype="bfloat16", resume=True, steps=3), log=lambda *a: None)
    assert all(g["ns_dtype"] == "bfloat16" for g in resumed.optimizer.param_groups if g["algo"] == "muon")
    with pytest.raises(RunMismatchError, match=r"--muon-dtype: the run recorded 'bfloat16', now 'float32'"):
        Trainer(args(run, resume=True, steps=3), log=lambda *a: None)
    switched = Trainer(args(run, resume=True, override=True, steps=3), log=lambda *a: None)
    assert all(g["ns_dtype"] == "float32" for g in switched.optimizer.param_groups if g["algo"] == "muon")
