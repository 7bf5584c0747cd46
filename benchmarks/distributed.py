"""Training throughput on 1 process against 2 (torch.distributed, gloo), 1 thread each, on the same global batch.

    python benchmarks/distributed.py                      # small preset, 4 × 256 tokens, 8 steps, 2 rounds
    python benchmarks/distributed.py --preset tiny --steps 6 --rounds 1      # a quick look

Every configuration runs `k3 train` (for 2 processes `k3 train --nproc 2`, torchrun) with OMP_NUM_THREADS=1 on
the same run-folder template: the tokenizer and packed tokens are made once (asyncio's source from the standard
library) and copied into a fresh folder per run, so the runs time training alone. tokens/s is the median over
the steps after the first two of the global batch's tokens over the step's wall time (what metrics.jsonl
records on rank 0). The configurations take turns, round after round, so a shared machine's drift hits them
alike. Scaling efficiency = tokens/s on 2 processes / (2 × tokens/s on 1).
"""

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch

CONFIGS = {
    "1 process": [],
    "2 processes, DDP": ["--nproc", "2"],
    "2 processes, FSDP2": ["--nproc", "2", "--dp", "fsdp"],
    "2 processes, DDP + EP 2": ["--nproc", "2", "--ep", "2"],
}
TEMPLATE_FILES = ("run.json", "tokenizer.json", "train_tokens.npy", "val_tokens.npy")


def train(out: Path, flags: list[str], extra: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "k3.cli", "train", "--out", str(out), *flags, *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)


def tokens_per_s(run: Path) -> float:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["tokens_per_s"] for r in records[2:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    if args.steps < 4:
        raise SystemExit("--steps must be at least 4 (the first two are not timed)")
    data = Path(sysconfig.get_paths()["stdlib"]) / "asyncio"

    def flags(steps: int) -> list[str]:
        return [
            "--preset",
            args.preset,
            "--batch-size",
            str(args.batch_size),
            "--seq-len",
            str(args.seq_len),
            "--steps",
            str(steps),
            "--warmup",
            "2",
            "--eval-every",
            str(10 * args.steps),
            "--eval-batches",
            "1",
            "--ckpt-every",
            str(10 * args.steps),
            "--vocab-size",
            "4096",
            "--data",
            str(data),
            "--no-progress",
        ]

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        template = tmp / "template"
        done = train(template, flags(1), [])  # the tokenizer and the tokens, and one step
        if done.returncode:
            raise SystemExit(done.stderr[-2000:])
        results: dict[str, list[float]] = {name: [] for name in CONFIGS}
        for r in range(args.rounds):
            for name, extra in CONFIGS.items():
                run = tmp / f"round{r}_config{list(CONFIGS).index(name)}"
                run.mkdir()
                for f in TEMPLATE_FILES:
                    shutil.copy(template / f, run / f)
                done = train(run, flags(args.steps), extra)
                if done.returncode:
                    raise SystemExit(f"{name}: {done.stderr[-2000:]}")
                results[name].append(tokens_per_s(run))
                print(f"round {r + 1} {name}: {results[name][-1]:.0f} tokens/s", flush=True)
    one = statistics.median(results["1 process"])
    load = os.getloadavg()
    print(
        f"\n{datetime.date.today()}, {platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, "
        f"load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1/5/15 min) at the end"
    )
    print(
        f"{args.preset} preset, global batch {args.batch_size} × {args.seq_len} tokens, {args.steps} steps, "
        f"{args.rounds} rounds, 1 thread per process\n"
    )
    print("| configuration | tokens/s (median of rounds) | vs 1 process | scaling efficiency |")
    print("|---|---|---|---|")
    for name, values in results.items():
        tps = statistics.median(values)
        eff = "" if name == "1 process" else f"{tps / (2 * one):.2f}"
        print(f"| {name} | {tps:.0f} | {tps / one:.2f}x | {eff} |")


if __name__ == "__main__":
    main()
