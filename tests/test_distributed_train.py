"""`k3 train --nproc 2` end to end (gloo, torchrun): the same losses as one process on the same global batch,
checkpoints that resume on another number of processes, `k3 export` of such a run, and a rank killed mid-step or
mid-checkpoint: a complete checkpoint stays, the other rank says so and exits, the resumed run has the same losses.

Losses agree to rtol 1e-5 (measured: ~1e-7; the ranks sum gradients in another order than one process does).
Every collective times out after K3_DIST_TIMEOUT_S = 20 s and every command after 180 s, so nothing hangs.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

from k3.formats.checkpoint import load_checkpoint, step_dirs
from k3.formats.files import latest_timeline, read_jsonl
from tiny_runs import tiny_train_args

STEPS = ["--steps", "6", "--warmup", "2", "--eval-every", "6", "--keep-last", "0"]
RTOL = 1e-5


def _args(tmp_path) -> list[str]:
    args = tiny_train_args(tmp_path)
    i = args.index("--steps")
    return [*args[:i], *args[i + 2 :], *STEPS]


def _k3(*argv, kill: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "K3_DIST_TIMEOUT_S": "20"}
    env.pop("K3_TEST_KILL", None)
    if kill is not None:
        env["K3_TEST_KILL"] = kill
    return subprocess.run(
        [sys.executable, "-m", "k3.cli", *map(str, argv)], env=env, capture_output=True, text=True, timeout=180
    )


def _losses(run) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in latest_timeline(read_jsonl(run / "metrics.jsonl"))}


def _same(got: dict[int, float], want: dict[int, float], steps) -> None:
    for s in steps:
        assert got[s] == pytest.approx(want[s], rel=RTOL), f"step {s}: {got[s]} vs one process {want[s]}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, 6 steps, checkpoints at 3 and 6: (run folder, losses, the train arguments)."""
    tmp = tmp_path_factory.mktemp("one")
    args = _args(tmp)
    run = tmp / "run"
    done = _k3(*args, "--ckpt-every", "3", "--out", run)
    assert done.returncode == 0, done.stderr
    return run, _losses(run), args


def test_two_processes_fsdp_and_expert_parallel_match_one_and_resume_on_one(reference, tmp_path):
    _, want, args = reference
    run = tmp_path / "two"
    done = _k3(*args, "--ckpt-every", "3", "--out", run, "--nproc", "2", "--dp", "fsdp", "--ep", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[0])["step"] == 6  # rank 0 alone prints the summary
    _same(_losses(run), want, range(1, 7))
    assert sorted(p.name for p in (run / "logs").iterdir()) == ["rank_0.log", "rank_1.log"]
    assert '"step": 6' in (run / "logs" / "rank_1.log").read_text()
    meta = json.loads((run / "step_00000006" / "meta.json").read_text())
    assert meta["state"]["parallel"] == {"world_size": 2, "ep": 2, "dp": "fsdp"}

    export = _k3("export", "--ckpt", run, "--out", tmp_path / "model")
    assert export.returncode == 0, export.stderr
    assert (tmp_path / "model" / "config.json").exists()

    shutil.rmtree(run / "step_00000006")  # resume the 2-process run's step 3 on one process
    done = _k3(*args, "--ckpt-every", "3", "--out", run, "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    _same(_losses(run), want, range(4, 7))


def test_a_rank_killed_mid_checkpoint_leaves_the_last_one_and_the_run_resumes(reference, tmp_path):
    _, want, args = reference
    run = tmp_path / "killed"
    flags = [*args, "--ckpt-every", "2", "--out", run, "--ep", "2", "--nproc", "2"]
    done = _k3(*flags, kill="1:checkpoint:4")  # rank 1 dies as the checkpoint of step 4 starts
    assert done.returncode != 0
    assert "k3 train (rank 0): stopping" in done.stderr, done.stderr[-3000:]
    assert "the last checkpoint is step 2" in done.stderr and "--resume" in done.stderr, done.stderr[-3000:]
    assert [p.name for p in step_dirs(run)] == ["step_00000002"], done.stderr[-3000:]
    assert load_checkpoint(run).step == 2  # complete: every file is there and matches its checksum
    done = _k3(*flags[: flags.index("--ep")], "--resume")  # on one process
    assert done.returncode == 0, done.stderr[-3000:]
    _same(_losses(run), want, range(1, 7))


@pytest.mark.slow
def test_a_rank_killed_mid_step_after_resuming_one_process_run_on_two(reference, tmp_path):
    one, want, args = reference
    run = tmp_path / "moved"
    shutil.copytree(one, run)
    shutil.rmtree(run / "step_00000006")
    flags = [*args, "--ckpt-every", "3", "--out", run]
    done = _k3(*flags, "--nproc", "2", "--resume", kill="1:step:5")  # 1 -> 2 processes, then a crash in step 5
    assert done.returncode != 0
    assert "k3 train (rank 0): stopping" in done.stderr, done.stderr[-3000:]
    assert _losses(run)[4] == pytest.approx(want[4], rel=RTOL)
    assert load_checkpoint(run).step == 3
    done = _k3(*flags, "--resume")  # and back on one
    assert done.returncode == 0, done.stderr[-3000:]
    _same(_losses(run), want, range(4, 7))


def test_launch_mistakes_are_one_line_before_any_process_starts(tmp_path, capsys):
    from k3.cli import main

    out = tmp_path / "never"
    cases = [
        (["--ep", "2"], "add --nproc N"),
        (["--nproc", "2", "--ep", "4"], "must divide the number of processes"),
        (["--nproc", "3", "--batch-size", "8"], "multiple of --nproc 3"),
    ]
    for flags, message in cases:
        assert main(["train", "--out", str(out), *flags]) == 2
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: --dp is ddp or fsdp
        main(["train", "--out", str(out), "--nproc", "2", "--dp", "zero"])
    assert not out.exists()
