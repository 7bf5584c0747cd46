"""Block Attention Residuals vs the standard residual (SPEC §2.5) on the small preset.

Three runs of `k3 train` from the same seed and data order: K3's Block AttnRes for S steps, the standard
residual (`residual="standard"`, the same model otherwise) for S steps, and the standard residual for
1.25·S steps (the compute the seed says it needs to match AttnRes). Reported: validation-loss curves,
the final validation losses, seconds per step, and the RMS of each sublayer's input (what attention or the
FFN reads, before its RMSNorm) by depth, at initialisation and after training, on one validation batch:
the running sum of a standard residual grows with depth (like √ℓ when the outputs are uncorrelated);
AttnRes's softmax mixture of block outputs is bounded by the largest of them.

    python experiments/attn_res.py                 # S = 200 steps of 8 x 256 tokens
    python experiments/attn_res.py --quick         # S = 6 steps of 2 x 64 tokens
    python experiments/attn_res.py --steps 20 --batch-size 4    # the reduced run docs/evidence.md shows
"""

import sys

import numpy as np
import torch
from common import Store, base_run, init_checkpoint, out_dir, parser, save_figure, train, vocab_size, write_tables

from k3.config import K3Config
from k3.hub import load_pretrained
from k3.model.norm import RMSNorm

NAME = "attn_res"
MATCH = 1.25  # the seed's reported compute advantage of AttnRes


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
    p.add_argument("--steps", type=int, default=None, help="S, the steps of the AttnRes run (default 200; 6 quick)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per step (default 8; 2 quick)")
    args = p.parse_args()
    out = out_dir(NAME, args)
    store = Store(out)
    steps = args.steps or (6 if args.quick else 200)
    batch = args.batch_size or (2 if args.quick else 8)
    seq_len = 64 if args.quick else 256
    base = base_run(args.quick)
    vocab = vocab_size(base)
    runs = {
        "attnres": ("attnres", steps),
        "standard": ("standard", steps),
        f"standard x{MATCH}": ("standard", round(MATCH * steps)),
    }
    val = torch.from_numpy(np.load(base / "val_tokens.npy")[: batch * seq_len].astype(np.int64)).view(batch, seq_len)
    for name, (residual, n) in runs.items():
        config = K3Config.from_preset("small", vocab_size=vocab, residual=residual)
        init = init_checkpoint(out / f"init-{residual}", config, base, seed=0)

        def run(init=init, n=n, name=name) -> dict:
            flags = [
                "--steps",
                str(n),
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
            records = train(out / f"train-{name.replace(' ', '')}", flags, base, init)
            return {
                "val": [(r["step"], r["val_loss"]) for r in records if "val_loss" in r],
                "step_s": float(np.median([r["step_s"] for r in records])),
            }

        store.run(f"train/{name}", run)
        for when, folder in (("init", init), ("trained", out / f"train-{name.replace(' ', '')}")):
            key = f"rms/{name}/{when}"
            store.run(key, lambda f=folder: {"rms": input_rms_by_sublayer(load_pretrained(f).model, val)})
    report(out, store, runs, steps, batch, seq_len)


def report(out, store, runs, steps, batch, seq_len) -> None:
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.2))
    rows = []
    for name, (_, n) in runs.items():
        r = store.get(f"train/{name}")
        s, v = zip(*r["val"], strict=True)
        ax.plot(s, v, "o-", ms=3, label=f"{name} ({n} steps)")
        rows.append([name, n, f"{v[-1]:.4f}", f"{r['step_s']:.2f}", f"{r['seconds']:.0f}"])
    ax.set(xlabel="step", ylabel="validation loss (nats/token)", title=f"small preset, {batch}x{seq_len} tokens/step")
    ax.legend()
    rms_rows = []
    for name, color in (("attnres", "C0"), ("standard", "C3")):
        for when, style in (("init", ":"), ("trained", "-")):
            rms = store.get(f"rms/{name}/{when}")["rms"]
            bx.plot(np.arange(1, len(rms) + 1) / 2, rms, style, color=color, label=f"{name}, {when}")
            rms_rows.append(
                [name, when, f"{rms[0]:.3f}", f"{rms[len(rms) // 2]:.3f}", f"{rms[-1]:.3f}", f"{rms[-1] / rms[0]:.1f}x"]
            )
    bx.set(
        xlabel="layer (two sublayers each)",
        ylabel="RMS of the sublayer's input",
        yscale="log",
        title="hidden-state size by depth (one validation batch)",
    )
    bx.legend()
    save_figure(fig, out / f"{NAME}.png")
    write_tables(
        out,
        [
            (
                f"validation loss, small preset, {batch}x{seq_len} tokens per step, seed 0",
                ["residual", "steps", "final validation loss", "median s/step", "run seconds"],
                rows,
            ),
            (
                "RMS of each sublayer's input by depth",
                ["residual", "weights", "first sublayer", "middle", "last", "last / first"],
                rms_rows,
            ),
        ],
    )


if __name__ == "__main__":
    sys.exit(main())
