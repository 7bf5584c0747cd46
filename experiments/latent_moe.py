"""LatentMoE vs a full-width MoE of the same expert count at equal active parameters (SPEC §2.3).

A LatentMoE expert reads and writes the latent (width L = d/2) behind one down-projection and one
up-projection shared by all experts; a full-width expert reads and writes d. With the expert hidden size
halved (I' = I/2), a full-width expert has the same parameters as a latent one (3·d·I/2 = 3·(d/2)·I), so
the two have the same expert count and the same active expert parameters. Per token and MoE layer:

    expert FLOPs        2 · k · 3 · width · I        (the same for both at equal parameters)
    latent projections  2 · 2 · d · L                (LatentMoE only)
    all-to-all bytes    2 · k · width · 2            (dispatch and combine, bf16 activations)

(a) That accounting for the released shape (preset k3) and the small preset, from their configs.
(b) Both small-preset variants trained by `k3 train` from the same seed for the same steps and tokens:
validation loss and seconds per step. Two differences from a plain MoE in the full-width variant as recorded: it
sets the latent to d, so it builds d x d down/up projections a plain MoE would not have (k3 now also builds
experts with none, routed_expert_hidden_size None, as Kimi Linear's; the runs here predate it), and the shared
expert's hidden size is moe_intermediate_size, so it is halved too. In the small preset that leaves the
full-width variant's MoE layers with 426K active parameters against LatentMoE's 458K (7% fewer).

    python experiments/latent_moe.py                 # 200 steps of 8 x 256 tokens per variant
    python experiments/latent_moe.py --quick         # 4 steps of 2 x 64
    python experiments/latent_moe.py --steps 20      # the reduced run docs/evidence.md shows
"""

import sys

import numpy as np
from common import Store, base_run, init_checkpoint, out_dir, parser, save_figure, train, vocab_size, write_tables

from k3.config import K3Config

NAME = "latent_moe"
BF16 = 2


def variants(preset: str, vocab: int | None = None) -> dict[str, K3Config]:
    extra = {} if vocab is None else {"vocab_size": vocab}
    latent = K3Config.from_preset(preset, **extra)
    full = K3Config.from_preset(
        preset,
        routed_expert_hidden_size=latent.hidden_size,
        moe_intermediate_size=latent.moe_intermediate_size // 2,
        **extra,
    )
    return {"LatentMoE": latent, "full-width MoE": full}


def accounting(config: K3Config, latent: bool) -> dict:
    """Per token and MoE layer: expert FLOPs, projection FLOPs, all-to-all bytes; expert parameters."""
    d, k, w, i = (
        config.hidden_size,
        config.num_experts_per_token,
        config.routed_expert_hidden_size,
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
    args = p.parse_args()
    out = out_dir(NAME, args)
    store = Store(out)
    steps = args.steps or (4 if args.quick else 200)
    batch, seq_len = (2, 64) if args.quick else (8, 256)
    base = base_run(args.quick)
    for name, config in variants("small", vocab_size(base)).items():
        folder = out / f"train-{name.split()[0].lower()}"

        def run(config=config, folder=folder) -> dict:
            init = init_checkpoint(out / f"init-{folder.name[6:]}", config, base, seed=0)
            flags = [
                "--steps",
                str(steps),
                "--batch-size",
                str(batch),
                "--seq-len",
                str(seq_len),
                "--seed",
                "0",
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

        store.run(f"train/{name}", run)
    report(out, store, steps, batch, seq_len)


def report(out, store, steps, batch, seq_len) -> None:
    import matplotlib.pyplot as plt

    rows = []
    for preset in ("k3", "small"):
        for name, config in variants(preset).items():
            a = accounting(config, name == "LatentMoE")
            rows.append(
                [
                    preset,
                    name,
                    config.routed_expert_hidden_size,
                    config.moe_intermediate_size,
                    f"{a['expert_params']:,}",
                    f"{a['expert_flops'] / 1e6:,.1f}",
                    f"{a['projection_flops'] / 1e6:,.1f}",
                    f"{a['all_to_all_bytes']:,}",
                ]
            )
    fig, ax = plt.subplots(figsize=(6, 4))
    train_rows = []
    for name in variants("small"):
        r = store.get(f"train/{name}")
        s, v = zip(*r["val"], strict=True)
        ax.plot(s, v, "o-", ms=3, label=name)
        train_rows.append([name, f"{v[-1]:.4f}", f"{r['step_s']:.2f}", f"{r['seconds']:.0f}"])
    ax.set(xlabel="step", ylabel="validation loss (nats/token)", title=f"small preset, {batch}x{seq_len} tokens/step")
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
                f"(b) small preset, {steps} steps of {batch}x{seq_len} tokens, seed 0",
                ["routed experts", "final validation loss", "median s/step", "run seconds"],
                train_rows,
            ),
        ],
    )


if __name__ == "__main__":
    sys.exit(main())
