"""The `k3` command line."""

import pytest

from k3.cli import main
from k3.ops.kda.backend import fla_version


def test_env_reports_the_cpu_backend(capsys, monkeypatch):
    monkeypatch.delenv("K3_KDA_BACKEND", raising=False)
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "KDA backend on cpu" in out and out.split("KDA backend on cpu")[1].split()[0] == "torch"
    assert "torch" in out and "cpu threads" in out


def test_unknown_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["frobnicate"])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_env_with_an_impossible_backend_says_why_instead_of_a_traceback(capsys, monkeypatch):
    """K3_KDA_BACKEND=fla on a machine without CUDA: `k3 env` reports it, and fla's version."""
    monkeypatch.setenv("K3_KDA_BACKEND", "fla")
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    line = next(row for row in out.splitlines() if row.startswith("KDA backend on cpu"))
    assert "error: K3_KDA_BACKEND=fla cannot run chunk_kda here" in line and "cuda tensors" in line
    fla = next(row for row in out.splitlines() if row.startswith("flash-linear-attention"))
    version = fla_version()
    assert fla.split(maxsplit=1)[1].startswith(f"{version}:" if version else "not installed")


# ---- training-side commands: train, quickstart, init, params, plot ----

import json  # noqa: E402  (appended section: the file's first part is another helper's)

from test_train import TRAIN as TINY_TRAIN  # noqa: E402  (one list of tiny-training flags)


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_corpus")
    for i in range(80):
        (root / f"m{i:03d}.py").write_text("".join(f"    v_{j} = f({i}, {j})\n" for j in range(i % 7 + 4)))
    return root


def test_every_train_and_quickstart_flag_has_a_help_line_with_its_default():
    import argparse

    from k3.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for command in ("train", "quickstart", "init"):
        for action in sub.choices[command]._actions:
            if action.dest == "help":
                continue
            assert action.help, (command, action.option_strings)
            assert "default" in action.help or action.required, (command, action.option_strings, action.help)
    text = sub.choices["quickstart"].format_help()
    assert "(default: runs/quickstart)" in text and "(default: 120)" in text.replace("\n", " ")


def test_train_checks_every_argument_before_any_work(tmp_path, capsys):
    from k3.train.trainer import TrainArgs

    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exc:
        main(["train", "--preset", "huge", "--out", str(out)])
    assert exc.value.code == 2 and "invalid choice: 'huge'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--preset 'huge' is not a preset"):
        TrainArgs(out=str(out), preset="huge")
    for bad, message in (
        (["--data", str(tmp_path / "nope")], "--data"),
        (["--resume"], "no checkpoint to resume"),
        (["--val-fraction", "1.5"], "--val-fraction must be between 0 and 1"),
        (["--init-from", str(tmp_path / "nope")], "--init-from"),
    ):
        assert main(["train", *TINY_TRAIN, "--out", str(out), *bad]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
        assert not out.exists()  # nothing left behind
    a_file = tmp_path / "file.txt"
    a_file.write_text("not a folder")
    for command in ("train", "init"):
        assert main([command, "--preset", "tiny", "--out", str(a_file)]) == 2
        assert "is a file; a" in capsys.readouterr().err
    assert a_file.read_text() == "not a folder"


def test_train_ends_with_what_to_run_next_and_params_reads_run_and_step_folders(tmp_path, small_corpus, capsys):
    run = tmp_path / "run"
    assert main(["train", *TINY_TRAIN, "--steps", "2", "--data", str(small_corpus), "--out", str(run)]) == 0
    out = capsys.readouterr().out
    assert f"k3 generate --model {run} " in out and f"k3 plot {run}" in out
    longer = next(line for line in out.splitlines() if "train twice as long" in line).split("#")[0].split()
    assert longer[:2] == ["k3", "train"] and "--resume" in longer and longer[longer.index("--steps") + 1] == "4"
    assert main(longer[1:]) == 0  # the suggested command runs as printed
    assert "resumed from" in capsys.readouterr().out

    assert main(["params", "--config", str(run), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert main(["params", "--config", str(run / "step_00000004"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == report
    assert main(["params", "--preset", "tiny", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["total"] != report["total"]  # the run's vocabulary is 400
    assert main(["params", "--config", str(tmp_path)]) == 2
    assert "not a run or step folder" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("meta", "message"),
    [("[1, 2]", "a JSON list"), ('{"format": "k3-checkpoint-1", "step": "3"}', "step must be a non-negative")],
)
def test_a_meta_json_of_the_wrong_shape_is_one_line_in_train_and_params(tmp_path, capsys, meta, message):
    run = tmp_path / "m"
    assert main(["init", "--preset", "tiny", "--out", str(run)]) == 0
    (run / "step_00000000" / "meta.json").write_text(meta)
    capsys.readouterr()
    assert main(["params", "--config", str(run / "step_00000000")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert main(["train", *TINY_TRAIN, "--out", str(run), "--resume"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_a_read_only_run_folder_is_one_line(tmp_path, small_corpus, capsys, monkeypatch):
    """Running as root, chmod does not stop a write; the OSError a read-only folder raises is raised instead."""
    import k3.formats.run_folder as run_folder

    def refuse(run, record):
        raise PermissionError(13, "Permission denied", str(run / "run.json"))

    monkeypatch.setattr(run_folder, "write_record", refuse)
    assert main(["train", *TINY_TRAIN, "--steps", "1", "--data", str(small_corpus), "--out", str(tmp_path / "r")]) == 2
    assert capsys.readouterr().err == f"k3 train: {tmp_path / 'r' / 'run.json'}: Permission denied\n"


def test_tensorboard_when_asked_for_and_missing_is_a_clear_error(tmp_path, small_corpus, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if the package were not installed
    args = ["train", *TINY_TRAIN, "--steps", "1", "--data", str(small_corpus), "--out", str(tmp_path / "r")]
    assert main([*args, "--tensorboard"]) == 2
    assert "--tensorboard needs the tensorboard package" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_ctrl_c_in_train_says_where_and_how_to_resume(tmp_path, small_corpus, sigint_default):
    import shlex
    import signal
    import subprocess
    import sys
    import time

    run = tmp_path / "run"
    args = ["train", *TINY_TRAIN, "--steps", "40", "--ckpt-every", "2", "--data", str(small_corpus), "--out", str(run)]
    proc = subprocess.Popen([sys.executable, "-m", "k3.cli", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while not (run / "step_00000002" / "meta.json").exists():
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.005)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    err = err.decode()
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith("k3 train: interrupted at step ") and "; resume with: k3 train " in line
    command = line.split("resume with: ")[1].split(" (continues from step")[0]
    assert "--resume" in command and main(shlex.split(command)[1:]) == 0
    assert max(json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()) == 40


def test_tensorboard_logs_next_to_the_metrics_when_installed(tmp_path, small_corpus):
    pytest.importorskip("torch.utils.tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "r"
    args = ["--steps", "3", "--data", str(small_corpus), "--out", str(run), "--tensorboard"]
    assert main(["train", *TINY_TRAIN, *args]) == 0
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3]
    assert [e.value for e in events.Scalars("loss")] == pytest.approx([r["loss"] for r in logged], rel=1e-6)
    assert [e.step for e in events.Scalars("val_loss")] == [3] and "maxvio/moe_layer_1" in events.Tags()["scalars"]
