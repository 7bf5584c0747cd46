"""LatentMoE vs a full-width MoE of the same expert count at equal expert parameters (SPEC §2.3).

A LatentMoE expert reads and writes the latent (width L = d/2) behind one down-projection and one
up-projection shared by all experts; a full-width expert reads and writes d. With the expert hidden size
halved (I' = I/2), a full-width expert has the same parameters as a latent one (3·d·I/2 = 3·(d/2)·I), so
the two have the same expert count and the same active expert parameters. Per token and MoE layer:

    expert FLOPs        2 · k · 3 · width · I        (the same for both at equal parameters)
    latent projections  2 · 2 · d · L                (LatentMoE only)
    all-to-all bytes    2 · k · width · 2            (dispatch and combine, bf16 activations)

(a) That accounting for the released shape (preset k3) and the small preset, from their configs.
(b) Both small-preset variants trained by `k3 train` from the same seed for the same steps and tokens, per
seed: validation loss and seconds per step. The full-width variant is a plain MoE: its experts read and write
x itself (routed_expert_hidden_size None: no W_down, W_up or latent norm), each with half LatentMoE's expert
hidden size, so the two have the same expert count and the same routed expert parameters; its shared experts
are two of half the hidden size, the same parameters as LatentMoE's one. LatentMoE alone has the latent
projections, 5% more active parameters in the small preset (11.17M against 10.65M).

The claim (b) tests: LatentMoE loses nothing in quality for halving the dispatch traffic. It holds for a seed if
LatentMoE's final validation loss is at most the full-width MoE's plus MARGIN.

    python experiments/latent_moe.py                 # 200 steps of 8 x 256 tokens per variant, seeds 0 and 1
    python experiments/latent_moe.py --quick         # 4 steps of 2 x 64, seed 0
    python experiments/latent_moe.py --steps 20 --seeds 0  # the reduced run of 2026-12-01 (before the plain MoE)
"""

import sys

import numpy as np
from common import (
    Store,
    base_run,
    init_checkpoint,
    out_dir,
    parser,
    per_seed_verdict,
    save_figure,
    train,
    vocab_size,
    write_evidence,
    write_tables,
)

from k3.config import K3Config
from k3.model.params import param_report

NAME = "latent_moe"
BF16 = 2
CLAIM = (
    "LatentMoE, which halves the bytes a token sends to its experts, loses no quality against a full-width MoE "
    "of the same expert count and routed expert parameters (SPEC §2.3)"
)
MARGIN = 0.02  # nats/token


def variants(preset: str, vocab: int | None = None) -> dict[str, K3Config]:
    extra = {} if vocab is None else {"vocab_size": vocab}
    latent = K3Config.from_preset(preset, **extra)
    full = K3Config.from_preset(
        preset,
        routed_expert_hidden_size=None,  # a plain MoE: experts read and write x, no latent projections or norm
        latent_moe_use_norm=False,
        moe_intermediate_size=latent.moe_intermediate_size // 2,
        num_shared_experts=2 * latent.num_shared_experts,  # the shared experts' parameters kept equal
        **extra,
    )
    return {"LatentMoE": latent, "full-width MoE": full}


def accounting(config: K3Config, latent: bool) -> dict:
    """Per token and MoE layer: expert FLOPs, projection FLOPs, all-to-all bytes; expert parameters."""
    d, k, w, i = (
        config.hidden_size,
        config.num_experts_per_token,
        config.expert_width,
        config.moe_intermediate_size,
    )
    return {
        "expert_params": 3 * w * i,
        "expert_flops": 2 * k * 3 * w * i,
        "projection_flops": 2 * 2 * d * w if latent else 0,
        "all_to_all_bytes": 2 * k * w * BF16,
    }


def main() -> None:
    p = parser(NAME, __doc__)
    p.add_argument("--steps", type=int, default=None, help="training steps per variant (default 200; 4 quick)")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="seeds (default 0 1; 0 quick)")
    args = p.parse_args()
    out = out_dir(NAME, args)
    store = Store(out)
    steps = args.steps or (4 if args.quick else 200)
    seeds = args.seeds or ([0] if args.quick else [0, 1])
    batch, seq_len = (2, 64) if args.quick else (8, 256)
    base = base_run(args.quick)
    for seed in seeds:
        for name, config in variants("small", vocab_size(base)).items():
            tag = f"{name.split()[0].lower()}-s{seed}"

            def run(config=config, tag=tag, seed=seed) -> dict:
                init = init_checkpoint(out / f"init-{tag}", config, base, seed=seed)
                flags = ["--steps", str(steps), "--batch-size", str(batch), "--seq-len", str(seq_len)]
                flags += ["--seed", str(seed), "--eval-every", str(max(1, steps // 10))]
                flags += ["--warmup", str(max(1, steps // 10))]
                records = train(out / f"train-{tag}", flags, base, init)
                return {
                    "val": [(r["step"], r["val_loss"]) for r in records if "val_loss" in r],
                    "step_s": float(np.median([r["step_s"] for r in records])),
                }

            store.run(f"train/{name}/s{seed}", run)
    report(out, args, store, seeds, steps, batch, seq_len, vocab_size(base))


def report(out, args, store, seeds, steps, batch, seq_len, vocab: int) -> None:
    import matplotlib.pyplot as plt

    rows = []
    for preset in ("k3", "small"):
        for name, config in variants(preset).items():
            a = accounting(config, name == "LatentMoE")
            rows.append(
                [
                    preset,
                    name,
                    config.expert_width,
                    config.moe_intermediate_size,
                    f"{a['expert_params']:,}",
                    f"{a['expert_flops'] / 1e6:,.1f}",
                    f"{a['projection_flops'] / 1e6:,.1f}",
                    f"{a['all_to_all_bytes']:,}",
                ]
            )
    fig, ax = plt.subplots(figsize=(6, 4))
    train_rows, evidence_rows, shown = [], [], []
    configs = variants("small", vocab)
    for seed in seeds:
        runs = {name: store.get(f"train/{name}/s{seed}") for name in configs}
        for color, (name, r) in zip(("C0", "C1"), runs.items(), strict=True):
            s, v = zip(*r["val"], strict=True)
            label = name if seed == seeds[0] else None
            ax.plot(s, v, "o-" if seed == seeds[0] else "s--", ms=3, color=color, label=label)
            active = param_report(configs[name])["active"]
            train_rows.append(
                [seed, name, f"{active / 1e6:.2f}M", f"{v[-1]:.4f}", f"{r['step_s']:.2f}", f"{r['seconds']:.0f}"]
            )
        gap = runs["LatentMoE"]["val"][-1][1] - runs["full-width MoE"]["val"][-1][1]
        shown.append(gap <= MARGIN)
        evidence_rows.append(
            {
                "seed": seed,
                **{field: {name: r[field] for name, r in runs.items()} for field in ("val", "step_s", "load")},
                "latent_minus_full": gap,
            }
        )
    ax.set(
        xlabel="step",
        ylabel="validation loss (nats/token)",
        title=f"small preset, {batch}x{seq_len} tokens/step (seed {seeds[0]}: circles)",
    )
    ax.legend()
    save_figure(fig, out / f"{NAME}.png")
    write_tables(
        out,
        [
            (
                "(a) per token and MoE layer (bf16 activations)",
                [
                    "preset",
                    "routed experts",
                    "expert width",
                    "expert hidden",
                    "params per expert",
                    "expert MFLOPs",
                    "projection MFLOPs",
                    "all-to-all bytes",
                ],
                rows,
            ),
            (
                f"(b) small preset, {steps} steps of {batch}x{seq_len} tokens",
                ["seed", "routed experts", "active params", "final validation loss", "median s/step", "run seconds"],
                train_rows,
            ),
        ],
    )
    write_evidence(
        NAME,
        out,
        args,
        store,
        claim=CLAIM,
        verdict=per_seed_verdict(shown),
        rule=(
            f"per seed, final validation loss after {steps} steps: reproduced if LatentMoE's is at most the "
            f"full-width MoE's + {MARGIN} on every seed, not reproduced if on no seed, mixed otherwise"
        ),
        seeds=seeds,
        steps=steps,
        rows=evidence_rows,
    )


if __name__ == "__main__":
    sys.exit(main())
