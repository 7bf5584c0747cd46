"""Hybrid 3:1 (KDA : MLA) vs all-KDA vs all-MLA (SPEC §2.9): recall by context length, decode memory and speed.

Variants of the small preset that differ only in which layers are MLA: K3's pattern (layers 4, 8, 9 of 9),
none (all KDA) or all nine. Parameters: 22.2M, 22.8M and 21.0M (within 6%: a KDA layer is a little larger
than an MLA layer at this width).

(a) Decode, no training needed: the cache held per sequence after L tokens (KDA states + MLA latents) and
the time of one decode step at context L, with the cache filled with random values of the right shapes
(the arithmetic does not depend on them), median of 5 steps, batch 1, fp32.

(b) Recall: each variant trained by `k3 train` for S steps (same seed, data order and tokens) with half of
the sequences replaced by the synthetic long-range tasks (`--synthetic-ratio 0.5`: retrieval, multihop,
count), then scored on the held-out examples at the training length and 2x, 4x beyond it
(k3.eval_lengths: the greedy answer must be exact).

    python experiments/hybrid.py                 # S = 200 steps of 8 x 256; eval at 256, 512, 1024; decode to 16K
    python experiments/hybrid.py --quick         # S = 4 steps of 2 x 128; eval at 128; decode to 2K
    python experiments/hybrid.py --steps 10 --examples 10    # the reduced run docs/evidence.md shows
"""

import statistics
import sys
import time

import torch
from common import Store, base_run, init_checkpoint, out_dir, parser, save_figure, train, vocab_size, write_tables

from k3.config import K3Config
from k3.eval_lengths import task_accuracy
from k3.hub import load_pretrained, load_tokenizer
from k3.model import K3Model
from k3.model.cache import K3Cache, KDALayerCache

NAME = "hybrid"
VARIANTS = {"hybrid 3:1": None, "all KDA": (), "all MLA": tuple(range(1, 10))}
TASKS = ("retrieval", "multihop", "count")


def config(variant: str, vocab: int = 8192) -> K3Config:
    return K3Config.from_preset("small", vocab_size=vocab, full_attn_layers=VARIANTS[variant])


@torch.no_grad()
def decode_cost(variant: str, length: int) -> dict:
    """Cache bytes and one decode step's seconds at context `length`, the cache filled with random values."""
    torch.manual_seed(0)
    cfg = config(variant)
    model = K3Model(cfg).eval()
    cache = K3Cache.empty(cfg)
    for layer in cache.layers:
        if isinstance(layer, KDALayerCache):
            layer.state = torch.randn(1, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_head_dim)
            layer.conv = torch.randn(1, 3 * cfg.kda_num_heads * cfg.kda_head_dim, cfg.short_conv_kernel_size - 1)
        else:
            layer.append(torch.randn(1, length, cfg.kv_lora_rank), torch.randn(1, length, cfg.qk_rope_head_dim))
    cache.seq_len = length
    times = []
    for _ in range(6):
        before = [(layer.latent, layer.k_pe) for layer in cache.layers if not isinstance(layer, KDALayerCache)]
        t0 = time.perf_counter()
        model(torch.tensor([[1]]), cache=cache)
        times.append(time.perf_counter() - t0)
        mla = [layer for layer in cache.layers if not isinstance(layer, KDALayerCache)]
        for layer, (latent, k_pe) in zip(mla, before, strict=True):  # back to `length` tokens for the next step
            layer.latent, layer.k_pe = latent, k_pe
        cache.seq_len = length
    nbytes = cache.nbytes()
    return {"kda_bytes": nbytes["kda"], "mla_bytes": nbytes["mla"], "step_s": statistics.median(times[1:])}


def main() -> None:
    p = parser(NAME, __doc__)
    p.add_argument("--steps", type=int, default=None, help="S, training steps per variant (default 200; 4 quick)")
    p.add_argument("--examples", type=int, default=None, help="held-out examples per task and length (40; 4 quick)")
    args = p.parse_args()
    out = out_dir(NAME, args)
    store = Store(out)
    decode_lengths = [256, 1024, 2048] if args.quick else [1024, 4096, 16384]
    for variant in VARIANTS:
        for length in decode_lengths:
            store.run(f"decode/{variant}/{length}", lambda v=variant, n=length: decode_cost(v, n))
    steps = args.steps or (4 if args.quick else 200)
    batch, seq_len = (2, 128) if args.quick else (8, 256)
    lengths = [seq_len] if args.quick else [seq_len, 2 * seq_len, 4 * seq_len]
    examples = args.examples or (4 if args.quick else 40)
    base = base_run(args.quick)
    for variant in VARIANTS:
        folder = out / f"train-{variant.replace(' ', '-').replace(':', '')}"

        def run(variant=variant, folder=folder) -> dict:
            init = init_checkpoint(out / f"init-{folder.name[6:]}", config(variant, vocab_size(base)), base, seed=0)
            flags = [
                "--steps",
                str(steps),
                "--batch-size",
                str(batch),
                "--seq-len",
                str(seq_len),
                "--seed",
                "0",
                "--synthetic-ratio",
                "0.5",
                "--eval-every",
                str(steps),
            ]
            records = train(folder, flags, base, init)
            return {"val_loss": records[-1]["val_loss"]}

        store.run(f"train/{variant}", run)
        for task in TASKS:
            for length in lengths:

                def score(folder=folder, task=task, length=length) -> dict:
                    pretrained = load_pretrained(folder)
                    result = task_accuracy(pretrained.model, load_tokenizer(pretrained), task, length, examples)
                    return {"accuracy": result.accuracy, "examples": result.examples}

                store.run(f"eval/{variant}/{task}/{length}", score)
    report(out, store, decode_lengths, lengths, steps, batch, seq_len, examples)


def report(out, store, decode_lengths, lengths, steps, batch, seq_len, examples) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2 + len(TASKS), figsize=(4 * (2 + len(TASKS)), 3.8))
    decode_rows, acc_rows = [], []
    for variant in VARIANTS:
        costs = [store.get(f"decode/{variant}/{n}") for n in decode_lengths]
        kib = [(c["kda_bytes"] + c["mla_bytes"]) / 1024 for c in costs]
        axes[0].plot(decode_lengths, kib, "o-", label=variant)
        axes[1].plot(decode_lengths, [1000 * c["step_s"] for c in costs], "o-", label=variant)
        decode_rows += [
            [variant, f"{n:,}", f"{k:,.0f}", f"{1000 * c['step_s']:.1f}"]
            for n, k, c in zip(decode_lengths, kib, costs, strict=True)
        ]
        row = [variant, f"{store.get(f'train/{variant}')['val_loss']:.3f}"]
        for i, task in enumerate(TASKS):
            accs = [store.get(f"eval/{variant}/{task}/{n}")["accuracy"] for n in lengths]
            axes[2 + i].plot(lengths, accs, "o-", label=variant)
            row += [f"{a:.0%}" for a in accs]
        acc_rows.append(row)
    axes[0].set(
        xscale="log", yscale="log", xlabel="context (tokens)", ylabel="cache per sequence (KiB)", title="decode cache"
    )
    axes[1].set(xscale="log", xlabel="context (tokens)", ylabel="ms per decode step (batch 1)", title="decode step")
    for i, task in enumerate(TASKS):
        axes[2 + i].set(
            xscale="log",
            xlabel="context (tokens)",
            ylabel="accuracy (held-out)",
            ylim=(-0.05, 1.05),
            title=f"{task}, after {steps} steps",
        )
    for ax in axes:
        ax.legend(fontsize=8)
    save_figure(fig, out / f"{NAME}.png")
    header = ["variant", "val loss"] + [f"{t} @ {n}" for t in TASKS for n in lengths]
    write_tables(
        out,
        [
            (
                "(a) decode: cache per sequence and one step's time (small preset, fp32, batch 1)",
                ["variant", "context", "cache KiB", "ms / step"],
                decode_rows,
            ),
            (
                f"(b) accuracy on {examples} held-out examples per cell after {steps} steps of "
                f"{batch}x{seq_len} tokens (half synthetic), seed 0",
                header,
                acc_rows,
            ),
        ],
    )


if __name__ == "__main__":
    sys.exit(main())
