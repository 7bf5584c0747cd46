"""The routed experts' optimiser, measured: time of the optimiser step and validation loss at equal steps.

    python benchmarks/expert_optimizer.py --steps 40 --warmup 5   # docs/benchmarks.md's run (~4 min quiet)
    python benchmarks/expert_optimizer.py                 # small preset, 4 × 128 tokens, 100 steps each
    python benchmarks/expert_optimizer.py --optimizer-only   # the optimiser step alone, order rotated

The alternatives (k3.train.optim: `k3 train --expert-optimizer`, `--expert-ns-steps`):

    (a) muon          Muon on every expert matrix every step, same-shape experts in batched Newton–Schulz calls
    (b) muon-active   no Newton–Schulz call for an expert without gradient this step (momentum and weight decay)
    (c) muon, 3 NS    3 Newton–Schulz steps for the expert matrices instead of 5
    (d) adamw         AdamW (with weight decay) for the routed experts
    (e) muon, bf16    (a) with every Newton–Schulz iteration in bf16 (`k3 train --muon-dtype bfloat16`; not only
                      the experts': each Muon matrix)

--only a,e runs a subset ((a) is always the reference).

Each alternative trains its own small-preset model from the same initialisation (--seed) on the same batches
(the standard library through k3's own pipeline: corpus split, BPE tokenizer, packing; the packed training
stream is every --doc-stride-th training file, the validation stream every validation file), with the same
loop as `k3 train` (warmup + cosine lr, Quantile Balancing, clipping at 1.0, lr 3e-3, weight decay 0.1). The
alternatives run in lockstep, one step of each in turn, so a shared machine's drift hits them alike; the table
gives medians over the steps after the first two, and ratios to (a).

--optimizer-only times the optimiser step alone on one small-preset model with fixed random gradients, each
alternative with its own optimiser state, the order rotated every round (so no alternative always runs
first): once with every routed expert holding a gradient, once with only 2 of each layer's 16 experts (what
muon-active can save when few experts receive tokens).
"""

import argparse
import datetime
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from k3 import K3Config, K3Model
from k3.train.balance import QuantileBalancer
from k3.train.corpus import load_corpus
from k3.train.data import PackedSequences, cached_pack
from k3.train.optim import build_optimizer, lr_at, routed_expert_weights, set_lr_factor
from k3.train.trainer import prepare_tokenizer

ALTERNATIVES = [  # (label, expert_optimizer, expert_ns_steps, ns_dtype: the dtype of every Newton–Schulz call)
    ("(a) muon", "muon", 5, "float32"),
    ("(b) muon-active", "muon-active", 5, "float32"),
    ("(c) muon, 3 NS steps", "muon", 3, "float32"),
    ("(d) adamw", "adamw", 5, "float32"),
    ("(e) muon, NS in bf16", "muon", 5, "bfloat16"),
]


class Run:
    """One alternative: its model, balancer and optimiser, and what its steps measured."""

    def __init__(self, label: str, expert_optimizer: str, ns_steps: int, ns_dtype: str, config: K3Config, args):
        self.label = label
        torch.manual_seed(args.seed)
        self.model = K3Model(config).train()
        self.balancer = QuantileBalancer(self.model)
        self.optimizer = build_optimizer(
            self.model,
            lr=args.lr,
            weight_decay=0.1,
            expert_optimizer=expert_optimizer,
            expert_ns_steps=ns_steps,
            ns_dtype=ns_dtype,
        )
        params = dict(self.model.named_parameters())
        self.experts = [params[n] for n in sorted(routed_expert_weights(self.model))]
        self.step_s: list[float] = []
        self.opt_s: list[float] = []
        self.active: list[float] = []
        self.losses: list[float] = []

    def step(self, batch: torch.Tensor, factor: float) -> None:
        t0 = time.perf_counter()
        set_lr_factor(self.optimizer, factor)
        out = self.model(batch, labels=batch)
        out.loss.backward()
        self.balancer.observe(out.routing)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.balancer.update()
        self.active.append(sum(p.grad is not None and bool(p.grad.any()) for p in self.experts) / len(self.experts))
        t1 = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        self.step_s.append(t2 - t0)
        self.opt_s.append(t2 - t1)
        self.losses.append(out.loss.item())

    @torch.no_grad()
    def val_loss(self, batches: list[torch.Tensor]) -> float:
        self.model.eval()
        loss = sum(self.model(b, labels=b).loss.item() for b in batches) / len(batches)
        self.model.train()
        return loss


def optimizer_only(rounds: int, alternatives: list[tuple]) -> None:
    torch.manual_seed(0)
    model = K3Model(K3Config.from_preset("small"))
    experts = routed_expert_weights(model)
    for label, active_experts in (("every expert has tokens", None), ("2 of 16 experts per layer have tokens", 2)):
        for name, p in model.named_parameters():
            p.grad = torch.randn_like(p) * 1e-3
            index = name.split(".experts.")[-1].split(".")[0]
            if active_experts is not None and name in experts and int(index) >= active_experts:
                p.grad = None
        opts = {
            lab: build_optimizer(model, expert_optimizer=o, expert_ns_steps=ns, ns_dtype=dt)
            for lab, o, ns, dt in alternatives
        }
        times: dict[str, list[float]] = {lab: [] for lab in opts}
        labels = list(opts)
        for r in range(rounds + 1):
            for lab in labels[r % len(labels) :] + labels[: r % len(labels)]:
                t0 = time.perf_counter()
                opts[lab].step()
                if r:  # the first round warms up
                    times[lab].append(time.perf_counter() - t0)
        base = statistics.median(times[labels[0]])
        print(f"\noptimiser step alone, {label}, medians of {rounds} rotated rounds:")
        for lab in labels:
            ms = statistics.median(times[lab])
            print(f"| {lab} | {1e3 * ms:.0f} ms | {ms / base:.2f}× (a) |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100, help="optimiser steps per alternative (default 100)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--seed", type=int, default=0, help="initialisation and data order (default 0)")
    p.add_argument("--val-batches", type=int, default=8)
    p.add_argument("--doc-stride", type=int, default=20, help="pack every N-th training file (default 20)")
    p.add_argument("--cache", default="runs/bench_expert_optimizer", help="tokenizer and packed tokens")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--optimizer-only", action="store_true", help="time the optimiser step alone (no training)")
    p.add_argument("--rounds", type=int, default=8, help="rounds of --optimizer-only (default 8)")
    p.add_argument("--only", default="a,b,c,d,e", help="the alternatives to run, by letter (default: all)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    letters = set(args.only.split(",")) | {"a"}
    alternatives = [alt for alt in ALTERNATIVES if alt[0][1] in letters]
    if args.optimizer_only:
        optimizer_only(args.rounds, alternatives)
        return
    load_before = os.getloadavg()

    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    train_docs, val_docs = load_corpus(None, 0.02, log=print)
    tokenizer = prepare_tokenizer(cache, train_docs, 8192)
    train = PackedSequences(
        cached_pack(cache / "train_tokens.npy", train_docs[:: args.doc_stride], tokenizer), args.seq_len, args.seed
    )
    val = PackedSequences(cached_pack(cache / "val_tokens.npy", val_docs, tokenizer), args.seq_len, 0)
    val_batches = val.fixed_batches(args.val_batches, args.batch_size)
    config = K3Config.from_preset("small", vocab_size=tokenizer.vocab_size)
    runs = [Run(label, opt, ns, dt, config, args) for label, opt, ns, dt in alternatives]
    print(
        f"small preset, {args.steps} steps of {args.batch_size} × {args.seq_len} tokens, seed {args.seed}, "
        f"lr {args.lr} (warmup {args.warmup}, cosine to 0.1), {torch.get_num_threads()} threads; training stream "
        f"{train.num_sequences} sequences, validation {len(val_batches)} × {args.batch_size} × {args.seq_len}",
        flush=True,
    )
    for step in range(args.steps):
        batch = train.batch(step * args.batch_size, args.batch_size)
        factor = lr_at(step, args.steps, min(args.warmup, args.steps))
        for run in runs:  # lockstep: one step of each alternative in turn
            run.step(batch, factor)
        if (step + 1) % 10 == 0:
            print(
                f"step {step + 1}: "
                + ", ".join(f"{r.label} loss {r.losses[-1]:.3f} opt {1e3 * r.opt_s[-1]:.0f} ms" for r in runs),
                flush=True,
            )
    load_after = os.getloadavg()

    def med(xs: list[float]) -> float:
        return statistics.median(xs[2:] if len(xs) > 4 else xs)

    base_opt, base_step = med(runs[0].opt_s), med(runs[0].step_s)
    base_val = runs[0].val_loss(val_batches)
    lines = [
        "| routed experts' optimiser | optimiser ms/step | × (a) | step ms | × (a) | experts with tokens "
        "| train loss (last 10) | val loss | − (a) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        opt, total = med(run.opt_s), med(run.step_s)
        v = base_val if run is runs[0] else run.val_loss(val_batches)
        lines.append(
            f"| {run.label} | {1e3 * opt:.0f} | {opt / base_opt:.2f} | {1e3 * total:.0f} | "
            f"{total / base_step:.2f} | {100 * statistics.mean(run.active):.1f}% | "
            f"{statistics.mean(run.losses[-10:]):.3f} | {v:.4f} | {v - base_val:+.4f} |"
        )
    print()
    print("\n".join(lines))
    print(
        f"\n{datetime.date.today()}, {platform.machine()}, {torch.get_num_threads()} threads, torch "
        f"{torch.__version__}; load average {load_before[0]:.1f} before, {load_after[0]:.1f} after; medians over "
        f"steps 3–{args.steps}"
    )


if __name__ == "__main__":
    main()
