"""Training in bf16 autocast against fp32, and compiled against eager, through `k3 train` itself: loss curves.

    python benchmarks/train_dtype.py                  # small preset, 4 × 128 tokens, 200 steps, seeds 0 and 1
    python benchmarks/train_dtype.py --steps 50 --modes float32 float32+compile --seeds 0   # compile fidelity

Each mode trains its own run folder with k3's Trainer (the standard library through k3's pipeline, warmup + cosine
lr, Quantile Balancing, Muon), from the same initialisation and on the same batches for a given seed; a mode is a
dtype (`--dtype float32|bfloat16`) with "+compile" for `--compile`. The table gives, per seed and mode, the mean
training loss of the last 10 steps, the validation loss at the end, the largest |loss − fp32's loss| over all
steps, and the median step time after the first 5 (the first compiles, when compiling). The runs go one after the
other; the losses do not depend on the machine's load, the step times do.
"""

import argparse
import datetime
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from k3.ops.compute_dtype import matmul_rates
from k3.train.trainer import TrainArgs, Trainer
from machine import cpu


def run(folder: Path, mode: str, seed: int, args) -> dict:
    dtype, _, compile = mode.partition("+")
    train_args = TrainArgs(
        out=str(folder),
        preset=args.preset,
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        seed=seed,
        eval_every=args.steps,
        dtype=dtype,
        compile=compile == "compile",
        progress=False,
    )
    t0 = time.perf_counter()
    Trainer(train_args, log=lambda *a: None).train()
    wall = time.perf_counter() - t0
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return {
        "losses": [r["loss"] for r in records],
        "val_loss": [r["val_loss"] for r in records if "val_loss" in r][-1],
        "step_s": statistics.median(r["step_s"] for r in records[5:]),
        "wall_s": wall,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--modes", nargs="+", default=["float32", "bfloat16"], help="dtype[+compile] (first: reference)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", help="also write the curves here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    fp32, bf16 = matmul_rates()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for mode in args.modes:
                results[(seed, mode)] = r = run(Path(tmp) / f"{seed}-{mode}", mode, seed, args)
                print(f"seed {seed} {mode}: val {r['val_loss']:.4f}, {r['step_s'] * 1e3:.0f} ms/step", flush=True)
    lines = [
        "| seed | mode | train loss (last 10) | val loss | − reference | max abs loss diff | step ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for (seed, mode), r in results.items():
        ref = results[(seed, args.modes[0])]
        diff = max(abs(a - b) for a, b in zip(r["losses"], ref["losses"], strict=True))
        delta = "" if mode == args.modes[0] else f"{r['val_loss'] - ref['val_loss']:+.4f}"
        lines.append(
            f"| {seed} | {mode} | {statistics.mean(r['losses'][-10:]):.4f} | {r['val_loss']:.4f} | {delta} "
            f"| {diff:.4f} | {r['step_s'] * 1e3:.0f} |"
        )
    print()
    print("\n".join(lines))
    print(
        f"\n{datetime.date.today()}, {cpu()}, {args.threads} threads, torch {torch.__version__}; matmul fp32 "
        f"{fp32:.0f} / bf16 {bf16:.0f} GFLOP/s; {args.preset} preset, {args.batch_size} × {args.seq_len} tokens, "
        f"{args.steps} steps"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({f"{s}/{m}": r for (s, m), r in results.items()}))


if __name__ == "__main__":
    main()
