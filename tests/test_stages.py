"""Staged context extension and the synthetic mix in the trainer: stage boundaries, tokens per micro-batch,
exact resume in the middle of a stage, readable errors."""

import json
import shutil

import numpy as np
import pytest

from k3.cli import main
from k3.formats.tokenizer import byte_tokenizer
from k3.train.data import PackedSequences
from k3.train.distributed import Parallel
from k3.train.stages import Stage, TrainBatches, parse_stages, stage_at, stage_rows
from k3.train.trainer import TrainArgs, Trainer
from tiny_runs import tiny_train_args


def test_parse_and_stage_boundaries():
    stages = parse_stages("256:100, 1024:50,4096:20")
    assert stages == [Stage(256, 100), Stage(1024, 50), Stage(4096, 20)]
    assert [stage_at(stages, s) for s in (0, 99, 100, 149, 150, 169, 170, 10_000)] == [0, 0, 1, 1, 2, 2, 2, 2]
    for bad, match in (("256", "LENGTH:STEPS"), ("256:x", "LENGTH:STEPS"), ("0:5", "at least 1")):
        with pytest.raises(ValueError, match=match):
            parse_stages(bad)
    with pytest.raises(ValueError, match="--stages"):
        TrainArgs(out="x", stages="1024")
    with pytest.raises(ValueError, match="--synthetic-ratio"):
        TrainArgs(out="x", synthetic_ratio=2.0)
    for tasks in ("mqar,recall", "mqar,mqar", ","):
        with pytest.raises(ValueError, match=r"--synthetic-tasks .*: name each task once, from retrieval"):
            TrainArgs(out="x", synthetic_ratio=0.5, synthetic_tasks=tasks)
    with pytest.raises(ValueError, match="there is no --synthetic-ratio"):
        TrainArgs(out="x", synthetic_tasks="mqar")


def test_synthetic_tasks_choose_the_mix(tmp_path):
    """--synthetic-tasks mqar: every replaced sequence of the run's batches is an mqar example, recorded in run.json."""
    args = tiny_train_args(tmp_path)
    args[args.index("--seq-len") + 1] = "256"
    args[args.index("--steps") + 1] = "1"
    run = tmp_path / "run"
    # 256 tokens: with this 300-token vocabulary mqar's four queries and their bindings take 143
    flags = [*args, "--val-fraction", "0.3", "--synthetic-ratio", "1", "--synthetic-tasks", "mqar", "--out", str(run)]
    assert main(flags) == 0
    assert json.loads((run / "run.json").read_text())["flags"]["synthetic_tasks"] == "mqar"
    from k3.cli import _train_args, build_parser

    trainer = Trainer(_train_args(build_parser().parse_args([*flags, "--resume"])))
    mix = trainer.batches.mix
    assert mix.tasks == ("mqar",)
    batch = trainer.batches.batch(0, 0)
    for row, position in zip(batch, range(len(batch)), strict=True):
        example = mix.example_at(position, 256)
        assert example.task == "mqar" and row.tolist() == example.tokens


def test_batches_keep_the_tokens_per_micro_batch_across_stages():
    tokens = np.arange(10_000, dtype=np.int32)
    base = PackedSequences(tokens, 64, seed=3)
    batches = TrainBatches(base, 8, parse_stages("64:2,256:2,1024:1"))
    shapes = [tuple(batches.batch(step, 0).shape) for step in range(6)]
    assert shapes == [(8, 64), (8, 64), (2, 256), (2, 256), (1, 1024), (1, 1024)]
    # each row is a contiguous run of the packed stream, cut at the stage's length
    row = batches.batch(2, 5)[0]
    assert row[0] % 256 == 0 and (row.diff() == 1).all()
    with pytest.raises(ValueError, match="longer than the training text"):
        TrainBatches(base, 8, parse_stages("64:1,20000:1"))


def test_mixed_batches_are_a_function_of_the_position():
    from k3.data.synthetic import SyntheticMix

    base = PackedSequences(np.zeros(4096, dtype=np.int32), 128, seed=0)
    mix = SyntheticMix(byte_tokenizer(), 0.5, seed=1)
    batches = TrainBatches(base, 4, None, mix)
    a, b = batches.batch(0, 12), TrainBatches(base, 4, None, SyntheticMix(byte_tokenizer(), 0.5, seed=1)).batch(0, 12)
    assert (a == b).all()
    replaced = [mix.example_at(p, 128) is not None for p in range(12, 16)]
    assert [bool((r != 0).any()) for r in a] == replaced


def test_a_mix_too_long_for_the_sequences_is_refused_before_training(tmp_path, capsys):
    args = tiny_train_args(tmp_path)
    assert main([*args, "--synthetic-ratio", "0.5", "--out", str(tmp_path / "run")]) == 2
    assert "does not fit in sequences of 32 tokens" in capsys.readouterr().err


def test_a_stage_whose_rows_do_not_split_over_the_processes_is_refused_up_front(tmp_path):
    # 4 rows of 64 tokens split over 2 processes, but a 256-token stage has 1 row: refused before any file
    args = TrainArgs(out=str(tmp_path / "run"), preset="tiny", batch_size=4, seq_len=64, stages="64:2,256:2")
    with pytest.raises(ValueError, match="256 tokens has 1 rows per micro-batch, which do not split over 2"):
        Trainer(args, parallel=Parallel(rank=0, world_size=2))
    assert not (tmp_path / "run").exists()
    assert stage_rows(4, 64, 128) == 2 and stage_rows(4, 64, 256) == 1  # the rows the check counted


def test_staged_run_resumed_mid_stage_matches_the_unbroken_run(tmp_path):
    args = tiny_train_args(tmp_path)
    args[args.index("--steps") + 1] = "5"
    args[args.index("--seq-len") + 1] = "128"
    flags = [*args, "--stages", "128:2,256:3", "--synthetic-ratio", "0.5", "--ckpt-every", "3", "--keep-last", "0"]
    unbroken = tmp_path / "unbroken"
    assert main([*flags, "--out", str(unbroken)]) == 0
    records = [json.loads(line) for line in (unbroken / "metrics.jsonl").read_text().splitlines()]
    assert [r["seq_len"] for r in records] == [128, 128, 256, 256, 256]

    resumed = tmp_path / "resumed"
    shutil.copytree(unbroken, resumed)
    shutil.rmtree(resumed / "step_00000005")  # back to step 3: the second stage's second step is next
    assert main([*flags, "--out", str(resumed), "--resume"]) == 0
    redone = {}
    for line in (resumed / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        redone[r["step"]] = r["loss"]
    assert redone == {r["step"]: r["loss"] for r in records}  # bitwise: the same batches, the same steps
    again = main([*args, "--stages", "128:2,512:3", "--out", str(resumed), "--resume"])
    assert again == 2  # another schedule is a changed flag, refused without --override
