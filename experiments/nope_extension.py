"""NoPE context extension by stages (SPEC §2.9): trained at the short length only vs with a later, longer stage.

Two runs of the small preset from the same seed, for the same steps and tokens per step: one on sequences
of L tokens throughout; one with `--stages L:3S/4,4L:S/4` (the last quarter of the steps on sequences
four times longer, the same tokens per step, nothing else changed: there is no positional encoding to
retune). Both are scored on the validation text at L, 4L and 16L tokens (k3.eval_lengths, through the
decoding cache): nats per token over the whole window and over its last quarter, where the context is
longest. A model that uses longer context should get better (lower) in the last quarter as L grows; one
that breaks beyond its training length gets worse.

    python experiments/nope_extension.py                          # S = 200 steps, L = 128, 8 sequences per step
    python experiments/nope_extension.py --quick                  # S = 4 steps, L = 64, 2 sequences per step
    python experiments/nope_extension.py --steps 40 --windows 4   # the reduced run docs/evidence.md shows
"""

import sys

import numpy as np
from common import Store, base_run, out_dir, parser, save_figure, train, write_tables

from k3.eval_lengths import lm_loss
from k3.hub import load_pretrained

NAME = "nope_extension"


def main() -> None:
    p = parser(NAME, __doc__)
    p.add_argument("--steps", type=int, default=None, help="S, steps per run (default 200; 4 quick)")
    p.add_argument("--windows", type=int, default=None, help="validation windows per length (default 8; 2 quick)")
    args = p.parse_args()
    out = out_dir(NAME, args)
    store = Store(out)
    steps = args.steps or (4 if args.quick else 200)
    L, batch = (64, 2) if args.quick else (128, 8)
    windows = args.windows or (2 if args.quick else 8)
    short = max(1, 3 * steps // 4)
    runs = {f"{L} only": [], f"{L} then {4 * L}": ["--stages", f"{L}:{short},{4 * L}:{steps - short}"]}
    base = base_run(args.quick)
    val = np.load(base / "val_tokens.npy").astype(np.int64)
    for name, stages in runs.items():
        folder = out / f"train-{name.replace(' ', '-')}"
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
            "0",
            "--eval-every",
            str(steps),
            *stages,
        ]
        store.run(f"train/{name}", lambda f=folder, flags=flags: {"val_loss": train(f, flags, base)[-1]["val_loss"]})
        for length in (L, 4 * L, 16 * L):

            def score(folder=folder, length=length) -> dict:
                r = lm_loss(load_pretrained(folder).model, val, length, windows)
                return {"nats": r.nats_per_token, "late": r.late_nats_per_token, "windows": r.examples}

            store.run(f"eval/{name}/{length}", score)
    report(out, store, runs, L, steps, batch, windows)


def report(out, store, runs, L, steps, batch, windows) -> None:
    import matplotlib.pyplot as plt

    lengths = [L, 4 * L, 16 * L]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    rows = []
    for name in runs:
        evals = [store.get(f"eval/{name}/{n}") for n in lengths]
        ax.plot(lengths, [e["nats"] for e in evals], "o-", label=name)
        bx.plot(lengths, [e["late"] for e in evals], "o-", label=name)
        rows.append(
            [
                name,
                f"{store.get(f'train/{name}')['val_loss']:.3f}",
                *(f"{e['nats']:.3f} / {e['late']:.3f}" for e in evals),
            ]
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
        a.legend()
    save_figure(fig, out / f"{NAME}.png")
    write_tables(
        out,
        [
            (
                f"validation nats/token (whole window / last quarter), {windows} windows per length; {steps} steps of "
                f"{batch * L} tokens, seed 0",
                ["training", f"val loss at {L}", *(f"at {n:,}" for n in lengths)],
                rows,
            ),
        ],
    )


if __name__ == "__main__":
    sys.exit(main())
