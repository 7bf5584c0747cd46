"""QAT beats PTQ (SPEC §2.8): a model trained with MXFP4 in the loop loses less to MXFP4 than the same model
rounded after training.

A shared full-precision warm start: the small preset trained W steps by `k3 train` (seed 0). From it, per
seed s, two continuations of K steps each on the same batches (`--seed s`, the same lr and schedule): (a) full
precision and (b) `--qat mxfp4` (routed experts compute with MXFP4 weights and MXFP8 inputs, straight-through
gradients; docs/quantization.md). The seeds are 1..N, so no continuation reads the data in the warm start's
order (seed 0) and repeats its batches. Then every model is scored on the same validation batches (the first
of the base run's val_tokens.npy, fixed):

    (a)  the full-precision run, served fp32;
    (b)  the QAT run, exported with `k3 export --quantize mxfp4` and served packed (`quantization="mxfp4"`;
         its config says expert_quantization mxfp4, so MXFP8 expert inputs as trained: the trained function);
    (b') the QAT run's master weights, unquantised ((b') − (a) shows how far two runs drift apart in K steps,
         the noise floor of every gap below);
    (c)  PTQ: (a) exported the same way (round-to-nearest MXFP4) and served packed with MXFP8 expert inputs,
         the function (b) computes, with weights that never saw the quantiser;
    (c') (a)'s export served weight-only (unquantised expert inputs, as the release is served).

Reported per seed: each model's validation loss and the paired gaps (c) − (a) (PTQ's cost), (b) − (a) (QAT's
served model against full precision), (b) − (c) (QAT against PTQ). evidence.json's verdict compares (b) with
(c) seed by seed (RULE), and records per seed whether PTQ cost anything at all: where rounding after training
costs nothing, there is nothing for QAT to win back and the regime cannot separate them.

Why this lr. benchmarks/qat.py continued a 120-step model for 40 steps at a constant 3e-4 (docs/benchmarks.md):
QAT and PTQ ended within 0.0002 of each other, both ~0.0015 above full precision, and QAT had little room to
move the weights towards ones that survive the rounding. Here the continuations run K = 100 steps at k3 train's
own peak lr, 3e-3, held constant after a 10-step warmup (`--min-lr-ratio 1.0`): 25x the lr·steps. The
full-precision run keeps moving its expert weights with no regard for the MXFP4 grid, and the QAT run's
forward sees the rounding at every step, so its gradient works against what the rounding costs. A constant lr
keeps the last steps as large as the first: nothing anneals either run at the end. The short warmup is there
because `--init-from` starts a fresh optimiser (Muon's momentum at zero) at the full lr.

    python experiments/qat.py                 # W = 120, seeds 1 and 2 x 2 runs of K = 100 steps of 8 x 256
    python experiments/qat.py --quick         # W = 4, 1 seed, K = 4 steps of 2 x 64, 2 val batches of 2 x 64

The full run trains 120 + 2 seeds x 2 x 100 = 520 steps of 8 x 256 tokens: about 20 min at ~2.3 s per
small-preset step on a quiet 2-core machine (a QAT step ~1.04x), then scores 10 models on 16 validation
batches of 8 x 256 (32,768 tokens; forward only, ~2-3 min with the exports): about 23 min in all.
"""

import sys
from pathlib import Path

import numpy as np
import torch
from common import Store, base_run, out_dir, parser, save_figure, train, write_evidence, write_tables

from k3.hub import export_model, load_pretrained
from k3.model.quantization import set_expert_quantization

NAME = "qat"
LR = 3e-3  # k3 train's default peak lr (TrainArgs.lr)
MARGIN = 0.001  # nats/token: a gap smaller than this is not counted as a difference
MODELS = {
    "fp": "(a) full precision, served fp32",
    "qat": "(b) QAT, exported and served packed (MXFP4 W, MXFP8 in)",
    "qat-master": "(b') QAT's master weights, unquantised",
    "ptq": "(c) PTQ of (a), served packed (MXFP4 W, MXFP8 in)",
    "ptq-weights": "(c') PTQ of (a), weight-only MXFP4",
}
GAPS = {  # name: (model, minus model, label)
    "ptq_cost": ("ptq", "fp", "(c) − (a): PTQ's cost"),
    "qat_vs_fp": ("qat", "fp", "(b) − (a): QAT served vs full precision"),
    "qat_vs_ptq": ("qat", "ptq", "(b) − (c): QAT vs PTQ"),
    "drift": ("qat-master", "fp", "(b') − (a): drift of the two runs, unquantised"),
}
CLAIM = (
    "QAT beats PTQ: a model trained with MXFP4 in the loop loses less to MXFP4 than the same model rounded "
    "after training (SPEC §2.8)"
)
RULE = (
    "per seed, the validation loss of the QAT run's packed export (b) against PTQ (c), the same seed's "
    "full-precision run exported the same way and served with the same MXFP8 expert inputs: reproduced if "
    f"b < c − {MARGIN} for every seed; not reproduced if b >= c − {MARGIN} for every seed; mixed otherwise "
    "(the seeds disagree)"
)


def validation_batches(base: Path, count: int, batch: int, seq_len: int) -> torch.Tensor:
    """(count, batch, seq_len) int64: the first count·batch sequences of base's val_tokens.npy, the same for
    every model scored."""
    tokens = np.load(base / "val_tokens.npy")
    need = count * batch * seq_len
    if len(tokens) < need:
        raise SystemExit(
            f"{base / 'val_tokens.npy'} holds {len(tokens)} tokens, fewer than {count} batches of {batch} x "
            f"{seq_len} ({need}); pass a smaller --eval-batches"
        )
    return torch.from_numpy(tokens[:need].astype(np.int64)).view(count, batch, seq_len)


@torch.no_grad()
def val_loss(model, batches: torch.Tensor) -> float:
    """Mean next-token loss over the batches (every batch the same size, so the mean of their means)."""
    model.eval()
    return float(np.mean([model(b, labels=b).loss.item() for b in batches]))


def packed_export(run: Path, folder: Path) -> Path:
    """`k3 export --quantize mxfp4` of run into folder, once (the export is written whole or not at all)."""
    if not (folder / "config.json").exists():
        export_model(run, folder, quantize="mxfp4", force=True)  # force: a leftover of an interrupted write
    return folder


def load_model(name: str, runs: dict[str, Path], out: Path, seed: int):
    """The model MODELS[name] describes, for this seed's two runs."""
    if name == "fp":
        return load_pretrained(runs["fp"]).model
    if name == "qat-master":
        model = load_pretrained(runs["qat"]).model
        set_expert_quantization(model, None)  # the same weights, the quantisers off
        return model
    source = "qat" if name == "qat" else "fp"
    model = load_pretrained(packed_export(runs[source], out / f"export-{source}-s{seed}"), quantization="mxfp4").model
    if name == "ptq":
        set_expert_quantization(model, "mxfp4")  # what a QAT model computes: MXFP8 expert inputs too
    expected = None if name == "ptq-weights" else "mxfp4"
    if model.config.expert_quantization != expected:
        raise RuntimeError(
            f"{MODELS[name]}: the served model's expert_quantization is {model.config.expert_quantization!r}, "
            f"not {expected!r}; the export did not carry the run's configuration"
        )
    return model


def main() -> None:
    p = parser(NAME, __doc__)
    p.add_argument("--seeds", type=int, default=None, help="seeds 1..N, two continuations each (default 2; 1 quick)")
    p.add_argument("--warm-steps", type=int, default=None, help="W, the warm start's steps (default 120; 4 quick)")
    p.add_argument("--steps", type=int, default=None, help="K, each continuation's steps (default 100; 4 quick)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per step and per val batch (8; 2 quick)")
    p.add_argument("--lr", type=float, default=LR, help=f"the continuations' constant lr (default {LR:g})")
    p.add_argument("--eval-batches", type=int, default=None, help="validation batches (default 16; 2 quick)")
    args = p.parse_args()
    out = out_dir(NAME, args)
    store = Store(out)
    seeds = list(range(1, (args.seeds or (1 if args.quick else 2)) + 1))
    warm_steps = args.warm_steps or (4 if args.quick else 120)
    steps = args.steps or (4 if args.quick else 100)
    batch = args.batch_size or (2 if args.quick else 8)
    seq_len = 64 if args.quick else 256
    base = base_run(args.quick)
    val = validation_batches(base, args.eval_batches or (2 if args.quick else 16), batch, seq_len)
    shape = ["--batch-size", str(batch), "--seq-len", str(seq_len)]

    warm = out / "warm"
    warm_flags = ["--preset", "small", "--steps", str(warm_steps), *shape, "--seed", "0"]
    warm_flags += ["--eval-every", str(warm_steps), "--warmup", str(max(1, warm_steps // 10))]
    store.run("warm", lambda: summary(train(warm, warm_flags, base)))
    for seed in seeds:
        runs = {kind: out / f"train-{kind}-s{seed}" for kind in ("fp", "qat")}
        for kind, folder in runs.items():
            flags = [
                "--steps",
                str(steps),
                *shape,
                "--seed",  # the data order: the same batches for both runs of a seed
                str(seed),
                "--lr",
                str(args.lr),
                "--warmup",
                str(max(1, steps // 10)),
                "--min-lr-ratio",  # constant after the warmup (module docstring)
                "1.0",
                "--eval-every",
                str(steps),
                *(["--qat", "mxfp4"] if kind == "qat" else []),
            ]
            store.run(
                f"train/{kind}/s{seed}", lambda folder=folder, flags=flags: summary(train(folder, flags, base, warm))
            )
        for name in MODELS:

            def score(name=name, runs=runs, seed=seed) -> dict:
                loss = val_loss(load_model(name, runs, out, seed), val)
                print(f"s{seed} {MODELS[name]}: validation loss {loss:.4f}", flush=True)
                return {"val_loss": loss}

            store.run(f"eval/{name}/s{seed}", score)
    report(out, args, store, seeds, warm_steps, steps, batch, seq_len, len(val))


def summary(records: list[dict]) -> dict:
    """What the table shows of a training run: its last validation loss (the trainer's own few batches),
    its training losses and its median step seconds."""
    return {
        "steps": records[-1]["step"],
        "val_loss": [r["val_loss"] for r in records if "val_loss" in r][-1],
        "loss": [r["loss"] for r in records],
        "step_s": float(np.median([r["step_s"] for r in records])),
    }


def verdict(qat_vs_ptq: list[float]) -> str:
    """RULE applied to (b) − (c) per seed."""
    if all(d < -MARGIN for d in qat_vs_ptq):
        return "reproduced"
    if all(d >= -MARGIN for d in qat_vs_ptq):
        return "not reproduced"
    return "mixed"


def report(out, args, store, seeds, warm_steps, steps, batch, seq_len, eval_batches) -> None:
    import matplotlib.pyplot as plt

    loss = {(name, s): store.get(f"eval/{name}/s{s}")["val_loss"] for name in MODELS for s in seeds}
    gap = {(key, s): loss[(m, s)] - loss[(minus, s)] for key, (m, minus, _) in GAPS.items() for s in seeds}
    outcome = verdict([gap[("qat_vs_ptq", s)] for s in seeds])
    ptq_cost = [{"seed": s, "nats": gap[("ptq_cost", s)], "costs": gap[("ptq_cost", s)] > MARGIN} for s in seeds]

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.2))
    x = np.arange(len(seeds))
    width = 0.8 / len(GAPS)
    for i, (key, (_, _, label)) in enumerate(GAPS.items()):
        color = "0.6" if key == "drift" else f"C{i}"
        ax.bar(x + (i - (len(GAPS) - 1) / 2) * width, [gap[(key, s)] for s in seeds], width, color=color, label=label)
    for level in (-MARGIN, MARGIN):
        ax.axhline(level, color="k", lw=0.6, ls=":")
    ax.axhline(0, color="k", lw=0.8)
    ax.set(
        xticks=x,
        xticklabels=[f"seed {s}" for s in seeds],
        ylabel="validation loss gap (nats/token)",
        title=f"paired gaps (dotted: ±{MARGIN}; negative: the first is better)",
    )
    ax.legend(fontsize=8)
    width = 0.8 / len(MODELS)
    for i, (name, label) in enumerate(MODELS.items()):
        bx.bar(x + (i - (len(MODELS) - 1) / 2) * width, [loss[(name, s)] for s in seeds], width, label=label)
    values = list(loss.values())
    spread = max(values) - min(values)
    bx.set(
        xticks=x,
        xticklabels=[f"seed {s}" for s in seeds],
        ylim=(min(values) - max(spread, 0.002), max(values) + 0.5 * max(spread, 0.002)),
        ylabel="validation loss (nats/token)",
        title=f"small preset, {warm_steps} + {steps} steps of {batch}x{seq_len}, lr {args.lr:g}",
    )
    bx.legend(fontsize=7, loc="upper left")
    save_figure(fig, out / f"{NAME}.png")

    train_rows = []
    for key, name, n in [("warm", "warm start (full precision, seed 0)", warm_steps)] + [
        (f"train/{kind}/s{s}", f"{kind} continuation, seed {s}", steps) for s in seeds for kind in ("fp", "qat")
    ]:
        r = store.get(key)
        train_rows.append(
            [
                name,
                n,
                f"{r['val_loss']:.4f}",
                f"{r['step_s']:.2f}",
                f"{r['seconds']:.0f}",
                "–".join(map(str, r["load"])),
            ]
        )
    costless = [c["seed"] for c in ptq_cost if not c["costs"]]
    notes = f"verdict: {outcome} ({RULE})"
    if costless:
        notes += (
            f"\n\nPTQ cost at most {MARGIN} nats for seed(s) {costless}: there rounding after training lost "
            "nothing for QAT to win back, and this regime cannot separate QAT from PTQ."
        )
    write_tables(
        out,
        [
            (
                f"validation loss on the same {eval_batches} batches of {batch}x{seq_len} tokens",
                ["model", *(f"seed {s}" for s in seeds), "mean"],
                [
                    [label, *(f"{loss[(n, s)]:.4f}" for s in seeds), f"{np.mean([loss[(n, s)] for s in seeds]):.4f}"]
                    for n, label in MODELS.items()
                ],
            ),
            (
                "paired gaps, nats/token (negative: the first model is better)",
                ["seed", *(label for _, _, label in GAPS.values()), f"PTQ costs > {MARGIN}"],
                [
                    [s, *(f"{gap[(k, s)]:+.4f}" for k in GAPS), "yes" if c["costs"] else "no"]
                    for s, c in zip(seeds, ptq_cost, strict=True)
                ],
            ),
            (
                f"training runs (continuations from the warm start: lr {args.lr:g} constant after "
                f"{max(1, steps // 10)} warmup steps)",
                ["run", "steps", "val loss (trainer's batches)", "median s/step", "seconds", "load average"],
                train_rows,
            ),
        ],
        notes=notes,
    )
    rows = [
        {
            "seed": s,
            "val_loss": {name: loss[(name, s)] for name in MODELS},
            **{key: gap[(key, s)] for key in GAPS},
            "step_s": {kind: round(store.get(f"train/{kind}/s{s}")["step_s"], 3) for kind in ("fp", "qat")},
        }
        for s in seeds
    ]
    write_evidence(
        NAME,
        out,
        args,
        store,
        claim=CLAIM,
        verdict=outcome,
        rule=RULE,
        seeds=seeds,
        steps={"warm": warm_steps, "fp": steps, "qat": steps},
        rows=rows,
        ptq_cost=ptq_cost,
        lr=args.lr,
        eval_tokens=eval_batches * batch * seq_len,
    )


if __name__ == "__main__":
    sys.exit(main())
