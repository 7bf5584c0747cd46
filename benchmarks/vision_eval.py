"""Does the vision tower, trained from scratch inside the LM, see? The small-vl preset trained on generated
images (k3.data.images) beside a text-only baseline trained the same way on the same sequences without
the image; both answer held-out questions greedily: the same distribution (eval), image sizes never seen
in training (eval-sizes) and colour-shape pairs never seen in training (eval-pairs).

    OMP_NUM_THREADS=2 python benchmarks/vision_eval.py --steps 300 --batch-size 16 --per-split 150

Prints exact-match accuracy per task and split, side by side, with the wall time of each training run,
and writes the table as JSON to --json when given. Run folders go under --out (vision and text-only).
"""

import argparse
import json
import time

from k3.train.trainer import TrainArgs
from k3.train.vision_trainer import answer_accuracy, train_vision

SPLITS = ("eval", "eval-sizes", "eval-pairs")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--per-split", type=int, default=150, help="held-out examples per split")
    p.add_argument("--out", default="runs/vision_eval")
    p.add_argument("--json", default=None)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    results = {}
    for name, use_images in (("vision", True), ("text-only", False)):
        args = TrainArgs(
            out=f"{a.out}/{name}",
            preset="small-vl",
            steps=a.steps,
            batch_size=a.batch_size,
            lr=a.lr,
            warmup=min(20, a.steps // 10),
            eval_every=max(1, a.steps // 4),
            eval_batches=4,
            seed=a.seed,
            progress=False,
        )
        run = train_vision(args, log=lambda m, n=name: print(f"[{n}] {m}", flush=True), use_images=use_images)
        t0 = time.perf_counter()
        acc = {s: answer_accuracy(run["model"], run["tokenizer"], s, a.per_split, use_images) for s in SPLITS}
        results[name] = {
            "train_seconds": run["seconds"],
            "val_loss": run["val_loss"],
            "accuracy": acc,
            "eval_seconds": time.perf_counter() - t0,
        }
        print(f"[{name}] trained {a.steps} steps in {run['seconds']:.0f} s, val loss {run['val_loss']:.3f}", flush=True)
    tasks = sorted({t for r in results.values() for s in SPLITS for t in r["accuracy"][s]})
    print(f"\n{'split':<11} {'task':<11} {'n':>4} {'vision':>8} {'text-only':>10}")
    for s in SPLITS:
        rows = [*tasks, "all"]
        for t in rows:
            cells = []
            for name in ("vision", "text-only"):
                acc = results[name]["accuracy"][s]
                c, n = (
                    (sum(v[0] for v in acc.values()), sum(v[1] for v in acc.values()))
                    if t == "all"
                    else acc.get(t, (0, 0))
                )
                cells.append((c, n))
            n = cells[0][1]
            if n:
                print(
                    f"{s:<11} {t:<11} {n:>4} "
                    + " ".join(f"{c / max(1, m):>{w}.1%}" for (c, m), w in zip(cells, (8, 10), strict=True))
                )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
