"""NoPE context extension by stages (SPEC §2.9): trained at the short length only vs with a later, longer stage.

Per seed, two runs of the small preset from that seed, for the same steps and tokens per step: one on sequences
of L tokens throughout; one with `--stages L:3S/4,4L:S/4` (the last quarter of the steps on sequences
four times longer, the same tokens per step, nothing else changed: there is no positional encoding to
retune). Both are scored on the validation text at L, 4L and 16L tokens (k3.eval_lengths, through the
decoding cache): nats per token over the whole window and over its last quarter, where the context is
longest. A model that uses longer context should get better (lower) in the last quarter as L grows; one
that breaks beyond its training length gets worse.

Verdict (evidence.json), per seed on the last quarter of 16L-token windows: reproduced if the staged run is
below the short-only run by more than MARGIN on every seed; not reproduced if on no seed; mixed otherwise.
Beside it, `no_breakdown` says per run whether the last quarter of a 16L window is no worse than that of an
L window (a model broken beyond its training length gets worse as the window grows; one without positions
to drive out of range need not).

    python experiments/nope_extension.py                          # 2 seeds x S = 200 steps, L = 128, 8 sequences
    python experiments/nope_extension.py --quick                  # 1 seed, S = 4 steps, L = 64, 2 sequences
    python experiments/nope_extension.py --steps 40 --windows 4 --seeds 1   # the reduced run of 2026-12-01
"""

import sys

import numpy as np
from common import (
    Store,
    base_run,
    out_dir,
    parser,
    per_seed_verdict,
    save_figure,
    train,
    write_evidence,
    write_tables,
)

from k3.eval_lengths import lm_loss
from k3.hub import load_pretrained

NAME = "nope_extension"
CLAIM = (
    "NoPE extends by stages with nothing retuned: a last stage on 4x longer sequences makes the model read "
    "16x its first length better than training short only (SPEC §2.9)"
)
MARGIN = 0.01  # nats/token: a gap smaller than this is not counted as a difference


def main() -> None:
    p = parser(NAME, __doc__)
    p.add_argument("--steps", type=int, default=None, help="S, steps per run (default 200; 4 quick)")
    p.add_argument("--windows", type=int, default=None, help="validation windows per length (default 8; 2 quick)")
    p.add_argument("--seeds", type=int, default=None, help="seeds 0..N-1, two runs each (default 2; 1 quick)")
    args = p.parse_args()
    out = out_dir(NAME, args)
    store = Store(out)
    steps = args.steps or (4 if args.quick else 200)
    L, batch = (64, 2) if args.quick else (128, 8)
    windows = args.windows or (2 if args.quick else 8)
    seeds = list(range(args.seeds or (1 if args.quick else 2)))
    short = max(1, 3 * steps // 4)
    runs = {f"{L} only": [], f"{L} then {4 * L}": ["--stages", f"{L}:{short},{4 * L}:{steps - short}"]}
    base = base_run(args.quick)
    val = np.load(base / "val_tokens.npy").astype(np.int64)
    for seed, (name, stages) in ((seed, run) for seed in seeds for run in runs.items()):
        folder = out / f"train-{name.replace(' ', '-')}-s{seed}"
        flags = [
            "--preset",
            "small",
            "--steps",
            str(steps),
            "--batch-size",
            str(batch),
            "--seq-len",
            str(L),
            "--seed",
            str(seed),
            "--eval-every",
            str(steps),
            *stages,
        ]
        key = f"{name}/s{seed}"
        store.run(f"train/{key}", lambda f=folder, flags=flags: {"val_loss": train(f, flags, base)[-1]["val_loss"]})
        for length in (L, 4 * L, 16 * L):

            def score(folder=folder, length=length) -> dict:
                r = lm_loss(load_pretrained(folder).model, val, length, windows)
                return {"nats": r.nats_per_token, "late": r.late_nats_per_token, "windows": r.examples}

            store.run(f"eval/{key}/{length}", score)
    report(out, store, args, runs, seeds, L, steps, batch, windows)


def report(out, store, args, runs, seeds, L, steps, batch, windows) -> None:
    import matplotlib.pyplot as plt

    lengths = [L, 4 * L, 16 * L]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    table, rows = [], []
    for i, name in enumerate(runs):
        for seed in seeds:
            key = f"{name}/s{seed}"
            evals = [store.get(f"eval/{key}/{n}") for n in lengths]
            style = "o-" if seed == 0 else "s--"
            ax.plot(lengths, [e["nats"] for e in evals], style, color=f"C{i}", label=f"{name}, seed {seed}")
            bx.plot(lengths, [e["late"] for e in evals], style, color=f"C{i}", label=f"{name}, seed {seed}")
            trained = store.get(f"train/{key}")
            val_loss, load = trained["val_loss"], trained["load"]
            table.append(
                [
                    name,
                    seed,
                    f"{val_loss:.3f}",
                    *(f"{e['nats']:.3f} / {e['late']:.3f}" for e in evals),
                    f"{load[0]:.2f} / {load[1]:.2f}",
                ]
            )
            rows.append(
                {
                    "training": name,
                    "seed": seed,
                    "val_loss": val_loss,
                    "nats": {n: e["nats"] for n, e in zip(lengths, evals, strict=True)},
                    "late_nats": {n: e["late"] for n, e in zip(lengths, evals, strict=True)},
                    "load": load,
                }
            )
    ax.set(xscale="log", xlabel="evaluation length (tokens)", ylabel="nats/token, whole window", title="all positions")
    bx.set(
        xscale="log",
        xlabel="evaluation length (tokens)",
        ylabel="nats/token, last quarter",
        title="the window's last quarter (longest context)",
    )
    for a in (ax, bx):
        a.axvline(L, color="grey", ls=":", lw=0.8)
        a.legend(fontsize=7)
    save_figure(fig, out / f"{NAME}.png")
    write_tables(
        out,
        [
            (
                f"validation nats/token (whole window / last quarter), {windows} windows per length; {steps} steps of "
                f"{batch * L} tokens, seeds {seeds}",
                ["training", "seed", f"val loss at {L}", *(f"at {n:,}" for n in lengths), "load before / after"],
                table,
            ),
        ],
    )
    short, staged = runs
    late = {(row["training"], row["seed"]): row["late_nats"][16 * L] for row in rows}
    gains = [late[(short, s)] - late[(staged, s)] for s in seeds]
    shown = [gain > MARGIN for gain in gains]
    verdict = per_seed_verdict(shown)
    write_evidence(
        NAME,
        out,
        args,
        store,
        claim=CLAIM,
        verdict=verdict,
        rule=(
            f"per seed, nats/token over the last quarter of {16 * L}-token windows: reproduced if the staged run "
            f"({staged}) is below the short-only run ({short}) by more than {MARGIN} on every seed, not reproduced "
            "if on no seed, mixed otherwise"
        ),
        seeds=seeds,
        steps={name: steps for name in runs},
        rows=rows,
        gain_at_16L=[{"seed": s, "nats": g} for s, g in zip(seeds, gains, strict=True)],
        no_breakdown=[
            {"training": row["training"], "seed": row["seed"], "holds": row["late_nats"][16 * L] <= row["late_nats"][L]}
            for row in rows
        ],
        length=L,
        windows=windows,
    )


if __name__ == "__main__":
    sys.exit(main())
