"""Block Attention Residuals vs the standard residual (SPEC §2.5) on the small preset.

Three runs of `k3 train` per seed, all three from that seed's data order and from step-0 checkpoints seeded
with it: K3's Block AttnRes for S steps, the standard residual (`residual="standard"`, the same model
otherwise) for S steps, and the standard residual for 1.25·S steps (the compute SPEC §2.5 says it needs to
match AttnRes). Reported: validation-loss curves, the final validation losses per seed and their mean,
seconds per step with the load average around each run, and the RMS of each sublayer's input (what
attention or the FFN reads, before its RMSNorm) by depth, at initialisation and after training, on one
validation batch (seed 0): the running sum of a standard residual grows with depth (like √ℓ when the
outputs are uncorrelated); AttnRes's softmax mixture of block outputs is bounded by the largest of them.
evidence.json's verdict compares the final validation losses seed by seed (see `verdict`).

    python experiments/attn_res.py                 # 2 seeds, S = 120 steps of 8 x 256 tokens
    python experiments/attn_res.py --quick         # 1 seed, S = 6 steps of 2 x 64 tokens
    python experiments/attn_res.py --seeds 1 --steps 20 --batch-size 4    # the reduced run docs/evidence.md shows

The full run trains 2 seeds x (120 + 120 + 150) = 780 steps: about 29 min at the ~2.2 s per step of the
small preset on a quiet 2-core machine.
"""

import sys

import numpy as np
import torch
from common import (
    Store,
    base_run,
    init_checkpoint,
    out_dir,
    parser,
    save_figure,
    train,
    vocab_size,
    write_evidence,
    write_tables,
)

from k3.config import K3Config
from k3.hub import load_pretrained
from k3.model.norm import RMSNorm

NAME = "attn_res"
MATCH = 1.25  # AttnRes's compute advantage as SPEC §2.5 reports it
LONG = f"standard x{MATCH}"
LOOK = {"attnres": ("C0", "-"), "standard": ("C3", "--"), LONG: ("C1", "-.")}  # colour and line style per run
CLAIM = "Block AttnRes matches a standard residual trained with 1.25x the compute (SPEC §2.5)"
RULE = (
    "per seed, the final validation loss of attnres after S steps (a) against the standard residual after S (s) "
    f"and after round({MATCH}·S) steps (l): reproduced if a <= l for every seed; otherwise not reproduced if "
    "a >= s for every seed (no gain at all); mixed otherwise (AttnRes beats the standard residual at S but not "
    f"at {MATCH}·S, or the seeds disagree)"
)


@torch.no_grad()
def input_rms_by_sublayer(model, batch: torch.Tensor) -> list[float]:
    """RMS of every sublayer's input (attention, then FFN, layer by layer) on `batch`."""
    norms = [m for layer in model.model.layers for m in (layer.input_layernorm, layer.post_attention_layernorm)]
    found: dict[int, float] = {}

    def keep(i: int):
        return lambda module, inputs: found.__setitem__(i, inputs[0].square().mean().sqrt().item())

    hooks = [m.register_forward_pre_hook(keep(i)) for i, m in enumerate(norms)]
    try:
        model(batch)
    finally:
        for h in hooks:
            h.remove()
    assert all(isinstance(m, RMSNorm) for m in norms)
    return [found[i] for i in range(len(norms))]


def main() -> None:
    p = parser(NAME, __doc__)
    p.add_argument("--seeds", type=int, default=None, help="seeds 0..N-1, three runs each (default 2; 1 quick)")
    p.add_argument("--steps", type=int, default=None, help="S, the steps of the AttnRes run (default 120; 6 quick)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per step (default 8; 2 quick)")
    args = p.parse_args()
    out = out_dir(NAME, args)
    store = Store(out)
    seeds = list(range(args.seeds or (1 if args.quick else 2)))
    steps = args.steps or (6 if args.quick else 120)
    batch = args.batch_size or (2 if args.quick else 8)
    seq_len = 64 if args.quick else 256
    base = base_run(args.quick)
    vocab = vocab_size(base)
    runs = {"attnres": ("attnres", steps), "standard": ("standard", steps), LONG: ("standard", round(MATCH * steps))}
    val = torch.from_numpy(np.load(base / "val_tokens.npy")[: batch * seq_len].astype(np.int64)).view(batch, seq_len)
    for seed in seeds:
        for name, (residual, n) in runs.items():
            config = K3Config.from_preset("small", vocab_size=vocab, residual=residual)
            init = init_checkpoint(out / f"init-{residual}-s{seed}", config, base, seed=seed)
            folder = out / f"train-{name.replace(' ', '')}-s{seed}"

            def run(init=init, n=n, folder=folder, seed=seed) -> dict:
                flags = [
                    "--steps",
                    str(n),
                    "--batch-size",
                    str(batch),
                    "--seq-len",
                    str(seq_len),
                    "--seed",  # the data order: the same for the three runs of a seed
                    str(seed),
                    "--eval-every",
                    str(max(1, steps // 10)),
                    "--warmup",
                    str(max(1, steps // 10)),
                ]
                records = train(folder, flags, base, init)
                return {
                    "val": [(r["step"], r["val_loss"]) for r in records if "val_loss" in r],
                    "step_s": float(np.median([r["step_s"] for r in records])),
                }

            store.run(f"train/{name}/s{seed}", run)
            if seed == 0 and name != LONG:  # the depth profile needs one seed, and the two residuals at equal steps
                for when, weights in (("init", init), ("trained", folder)):
                    key = f"rms/{name}/{when}/s{seed}"
                    store.run(key, lambda f=weights: {"rms": input_rms_by_sublayer(load_pretrained(f).model, val)})
    report(out, args, store, runs, seeds, steps, batch, seq_len)


def verdict(final: dict[str, list[float]]) -> str:
    """RULE applied to the final validation losses, {run name: [loss per seed]}."""
    pairs = list(zip(final["attnres"], final["standard"], final[LONG], strict=True))
    if all(a <= long for a, _, long in pairs):
        return "reproduced"
    if all(a >= s for a, s, _ in pairs):
        return "not reproduced"
    return "mixed"


def report(out, args, store, runs, seeds, steps, batch, seq_len) -> None:
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.2))
    rows, evidence_rows, final = [], [], {}
    for name, (residual, n) in runs.items():
        color, style = LOOK[name]
        results = [store.get(f"train/{name}/s{seed}") for seed in seeds]
        curves = np.array([[v for _, v in r["val"]] for r in results])  # (seeds, evals): one eval schedule per run
        at = [s for s, _ in results[0]["val"]]
        if len(seeds) > 1:
            for curve in curves:
                ax.plot(at, curve, style, color=color, lw=0.7, alpha=0.4)
        ax.plot(at, curves.mean(0), style, marker="o", ms=3, color=color, label=f"{name} ({n} steps)")
        final[name] = [float(r["val"][-1][1]) for r in results]
        loads = [x for r in results for x in r["load"]]
        rows.append(
            [
                name,
                n,
                *(f"{v:.4f}" for v in final[name]),
                f"{np.mean(final[name]):.4f}",
                " / ".join(f"{r['step_s']:.2f}" for r in results),
                " / ".join(f"{r['seconds']:.0f}" for r in results),
                f"{min(loads):.2f}–{max(loads):.2f}",
            ]
        )
        for seed, r in zip(seeds, results, strict=True):
            evidence_rows.append(
                {
                    "name": name,
                    "residual": residual,
                    "steps": n,
                    "seed": seed,
                    "val_loss": r["val"][-1][1],
                    "step_s": round(r["step_s"], 3),
                    "seconds": round(r["seconds"], 1),
                    "load": r["load"],
                }
            )
    thin = " (thin: each seed)" if len(seeds) > 1 else ""
    ax.set(
        xlabel="step",
        ylabel="validation loss (nats/token)",
        title=f"small preset, {batch}x{seq_len} tokens/step; mean of seeds {seeds}{thin}",
    )
    ax.legend()
    rms_rows = []
    for name in ("attnres", "standard"):
        color = LOOK[name][0]
        for when, style in (("init", ":"), ("trained", "-")):
            rms = store.get(f"rms/{name}/{when}/s0")["rms"]
            bx.plot(np.arange(1, len(rms) + 1) / 2, rms, style, color=color, label=f"{name}, {when}")
            rms_rows.append(
                [name, when, f"{rms[0]:.3f}", f"{rms[len(rms) // 2]:.3f}", f"{rms[-1]:.3f}", f"{rms[-1] / rms[0]:.1f}x"]
            )
    bx.set(
        xlabel="layer (two sublayers each)",
        ylabel="RMS of the sublayer's input",
        yscale="log",
        title="hidden-state size by depth (one validation batch, seed 0)",
    )
    bx.legend()
    save_figure(fig, out / f"{NAME}.png")
    outcome = verdict(final)
    gaps = [
        [seed, f"{a - s:+.4f}", f"{a - long:+.4f}"]
        for seed, a, s, long in zip(seeds, final["attnres"], final["standard"], final[LONG], strict=True)
    ]
    write_tables(
        out,
        [
            (
                f"final validation loss, small preset, {batch}x{seq_len} tokens per step, seeds {seeds}",
                [
                    "run",
                    "steps",
                    *(f"seed {s}" for s in seeds),
                    "mean",
                    "median s/step (per seed)",
                    "run seconds (per seed)",
                    "load average (min–max)",
                ],
                rows,
            ),
            (
                "AttnRes minus the standard residual, final validation loss (negative: AttnRes better)",
                ["seed", f"attnres − standard ({steps} steps)", f"attnres − {LONG} ({runs[LONG][1]} steps)"],
                gaps,
            ),
            (
                "RMS of each sublayer's input by depth (seed 0)",
                ["residual", "weights", "first sublayer", "middle", "last", "last / first"],
                rms_rows,
            ),
        ],
        notes=f"verdict: {outcome} ({RULE})",
    )
    write_evidence(
        NAME,
        out,
        args,
        store,
        claim=CLAIM,
        verdict=outcome,
        rule=RULE,
        seeds=seeds,
        steps={name: n for name, (_, n) in runs.items()},
        rows=evidence_rows,
    )


if __name__ == "__main__":
    sys.exit(main())
