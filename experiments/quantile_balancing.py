"""Quantile Balancing vs the fixed-step bias (SPEC §2.6): MaxVio over steps for three rules.

(a) Synthetic router scores at the released shape, 896 experts and top-16: per step m tokens whose
logits are an expert's popularity (skewed: N(0, 0.5²) across experts) plus token noise (N(0, 1)); the
popularities drift (a random walk of 0.02 per step) and at the middle step a quarter of the experts
get new popularities (a change of data). The scores go through k3's own Router (identity weights, so
sigmoid(logits) are the scores) and the balancers the trainer uses; every rule sees the same scores.
Rules: QB with the (k+1)-th score as cutoff (the default), QB with the exact cutoff, the fixed step
(u = 1e-3), and no balancing for reference; "floor" is the MaxVio of the same noise without any skew,
what finite batches leave even when every expert is equally popular (no bias can beat it on average).
MaxVio of each step is measured under the bias set from the steps before it.

(b) The small preset trained by `k3 train` with each rule (same seed, data and steps): MaxVio per
step, averaged over the MoE layers, and the validation loss at the end.

    python experiments/quantile_balancing.py            # 3 seeds x 200 steps of 4096 tokens; 3 x 80 training steps
    python experiments/quantile_balancing.py --quick    # 1 seed x 60 steps of 2048 tokens; 3 x 6 training steps
    python experiments/quantile_balancing.py --seeds 1 --steps 120 --train-steps 10    # docs/evidence.md's run
"""

import sys

import numpy as np
import torch
from common import Store, base_run, out_dir, parser, save_figure, train, write_tables

from k3.model.router import Router
from k3.train.balance import FixedStepBalancer, QuantileBalancer

NAME = "quantile_balancing"
RULES = {
    "qb": "QB, (k+1)-th cutoff (default)",
    "qb-exact": "QB, exact cutoff",
    "fixed": "fixed step u=1e-3",
    "none": "no balancing",
    "floor": "floor: no skew, no balancing",
}
TRAIN_FLAGS = {
    "qb": ["--balancer", "quantile"],
    "qb-exact": ["--balancer", "quantile", "--qb-exact-cutoff"],
    "fixed": ["--balancer", "fixed"],
}


def synthetic_maxvio(rule: str, seed: int, steps: int, tokens: int, experts: int = 896, top_k: int = 16) -> list:
    """MaxVio per step of one rule on the seeded stream of drifting, skewed router scores."""
    torch.manual_seed(0)
    router = Router(experts, experts, top_k)
    with torch.no_grad():
        router.weight.copy_(torch.eye(experts))
    balancer = {
        "qb": lambda: QuantileBalancer([router]),
        "qb-exact": lambda: QuantileBalancer([router], exact_cutoff=True),
        "fixed": lambda: FixedStepBalancer([router]),
    }.get(rule, lambda: None)()
    gen = torch.Generator().manual_seed(seed)
    skew = 0.0 if rule == "floor" else 0.5
    popularity = skew * torch.randn(experts, generator=gen)
    out = []
    for step in range(steps):
        popularity += skew * 0.02 * torch.randn(experts, generator=gen)
        if step == steps // 2:  # a change of data: a quarter of the experts get new popularities
            moved = torch.randperm(experts, generator=gen)[: experts // 4]
            popularity[moved] = skew * torch.randn(len(moved), generator=gen)
        logits = popularity + torch.randn(tokens, experts, generator=gen)
        with torch.no_grad():
            routed = router(logits)
        if balancer is None:
            loads = routed.loads_E.double()
            out.append(((loads.max() - loads.mean()) / loads.mean()).item())
        else:
            balancer.observe([routed])
            out.append(balancer.update()[0])
    return out


def main() -> None:
    p = parser(NAME, __doc__)
    p.add_argument("--seeds", type=int, default=None, help="seeds of the synthetic part (default 3; 1 with --quick)")
    p.add_argument("--steps", type=int, default=None, help="steps of the synthetic part (default 200; 60 quick)")
    p.add_argument("--train-steps", type=int, default=None, help="steps of each training run (default 80; 6 quick)")
    args = p.parse_args()
    out = out_dir(NAME, args)
    store = Store(out)
    seeds, steps, tokens = ([0], 60, 2048) if args.quick else ([0, 1, 2], 200, 4096)
    seeds = list(range(args.seeds)) if args.seeds else seeds
    steps = args.steps or steps
    for rule in RULES:
        for seed in seeds:
            key = f"synthetic/{rule}/{seed}"
            store.run(key, lambda r=rule, s=seed: {"maxvio": synthetic_maxvio(r, s, steps, tokens)})
    train_steps = args.train_steps or (6 if args.quick else 80)
    shape = ["--batch-size", "4", "--seq-len", "64"] if args.quick else ["--batch-size", "8", "--seq-len", "256"]
    base = base_run(args.quick)
    for rule, flags in TRAIN_FLAGS.items():

        def run(flags=flags, rule=rule) -> dict:
            flags = [
                "--preset",
                "small",
                "--steps",
                str(train_steps),
                "--seed",
                "0",
                "--eval-every",
                str(train_steps),
                *shape,
                *flags,
            ]
            records = train(out / f"train-{rule}", flags, base)
            return {
                "maxvio": [float(np.mean(r["maxvio"])) for r in records],
                "val_loss": records[-1]["val_loss"],
                "train_s": sum(r["step_s"] for r in records),
            }

        store.run(f"train/{rule}", run)
    report(out, store, seeds, steps, tokens, train_steps, shape)


def report(out, store, seeds, steps, tokens, train_steps, shape) -> None:
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.2))
    rows, half = [], steps // 2
    for rule, label in RULES.items():
        mean = np.array([store.get(f"synthetic/{rule}/{s}")["maxvio"] for s in seeds]).mean(0)
        ax.plot(range(1, steps + 1), mean, label=label)
        secs = sum(store.get(f"synthetic/{rule}/{s}")["seconds"] for s in seeds)
        cells = [
            mean[0],
            mean[1],
            mean[5],
            mean[half - 10 : half].mean(),
            mean[half],
            mean[half + 1],
            mean[-20:].mean(),
        ]
        rows.append([label, *(f"{c:.2f}" for c in cells), f"{secs:.0f}"])
    ax.set(
        yscale="log",
        xlabel="step",
        ylabel="MaxVio (mean over seeds)",
        title=f"synthetic scores: 896 experts, top-16, {tokens} tokens/step, seeds {seeds}",
    )
    ax.axvline(half + 1, color="grey", lw=0.6, ls=":")
    ax.legend()
    train_rows = []
    for rule in TRAIN_FLAGS:
        result = store.get(f"train/{rule}")
        bx.plot(range(1, len(result["maxvio"]) + 1), result["maxvio"], label=RULES[rule])
        last = np.mean(result["maxvio"][-10:])
        train_rows.append([RULES[rule], f"{last:.3f}", f"{result['val_loss']:.3f}", f"{result['train_s']:.0f}"])
    bx.set(
        yscale="log",
        xlabel="step",
        ylabel="MaxVio (mean over MoE layers)",
        title=f"small preset, {train_steps} steps of {shape[1]}x{shape[3]} tokens, seed 0",
    )
    bx.legend()
    save_figure(fig, out / f"{NAME}.png")
    synthetic_header = [
        "rule",
        "step 1",
        "step 2",
        "step 6",
        f"steps {half - 9}-{half}",
        f"step {half + 1} (shift)",
        f"step {half + 2}",
        "last 20 steps",
        "seconds",
    ]
    write_tables(
        out,
        [
            (
                f"(a) synthetic router scores, 896 experts, top-16, {tokens} tokens/step, {steps} steps, "
                f"seeds {seeds}: MaxVio",
                synthetic_header,
                rows,
            ),
            (
                f"(b) small preset, {train_steps} steps of {shape[1]}x{shape[3]} tokens, seed 0",
                ["rule", "MaxVio, mean of the last 10 steps", "validation loss", "training seconds"],
                train_rows,
            ),
        ],
    )


if __name__ == "__main__":
    sys.exit(main())
