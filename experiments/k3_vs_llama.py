"""K3 small vs an HF Llama of equal active parameters, trained by the same loop for equal wall-clock time.

The Llama is benchmarks/train_step.py's: HF transformers' LlamaForCausalLM with K3-small's width, heads,
vocabulary and untied head, its depth and MLP width chosen so its parameters come closest to K3-small's
active parameters. Both train in one process, in lockstep: one K3 step, one Llama step, so the load of a
shared machine falls on both alike; each stops when its own summed step time reaches the budget. Same
batches (the base run's packed standard library, seed 0), same optimiser (k3's Muon + AdamW, lr 3e-3 after
20 warmup steps, weight decay 0.1, clipping at 1), fp32. K3 also runs its Quantile Balancing update, which
is part of its step. Validation loss (the trainer's 4 fixed batches) is taken when each model's clock
passes B and 4B seconds (B = the quickstart's training time), and each greedily continues the same prompt.

    python experiments/k3_vs_llama.py                  # B = 200 s: 800 s of training per model
    python experiments/k3_vs_llama.py --quick          # B = 10 s, 2 x 64 tokens per step
    python experiments/k3_vs_llama.py --budget 60      # the reduced run docs/evidence.md shows
"""

import sys
import time
from pathlib import Path

import numpy as np
import torch
from common import Store, base_run, out_dir, parser, save_figure, write_tables

from k3 import K3Config, K3Model
from k3.formats.tokenizer import K3Tokenizer
from k3.model.params import param_report
from k3.train.balance import QuantileBalancer
from k3.train.data import PackedSequences
from k3.train.optim import build_optimizer, set_lr_factor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from train_step import llama_like

NAME = "k3_vs_llama"
PROMPT = "def fibonacci(n):\n"
WARMUP = 20


class Run:
    """One model's training state: optimiser, clock, and what was measured."""

    def __init__(self, name: str, model, balancer=None):
        self.name, self.model, self.balancer = name, model, balancer
        self.optimizer = build_optimizer(model, lr=3e-3, weight_decay=0.1)
        self.seconds, self.steps, self.val = 0.0, 0, []

    def step(self, batch: torch.Tensor) -> None:
        t0 = time.perf_counter()
        set_lr_factor(self.optimizer, min(1.0, (self.steps + 1) / WARMUP))
        out = self.model(batch, labels=batch)
        out.loss.backward()
        if self.balancer is not None:
            self.balancer.observe(out.routing)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        if self.balancer is not None:
            self.balancer.update()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.seconds += time.perf_counter() - t0
        self.steps += 1

    @torch.no_grad()
    def evaluate(self, val_batches) -> float:
        self.model.eval()
        loss = float(np.mean([self.model(b, labels=b).loss.item() for b in val_batches]))
        self.model.train()
        return loss

    @torch.no_grad()
    def sample(self, tokenizer, tokens: int = 48) -> str:
        ids = torch.tensor([tokenizer.encode(PROMPT)])
        self.model.eval()
        for _ in range(tokens):  # greedy, uncached: the same arithmetic for both models
            ids = torch.cat([ids, self.model(ids).logits[:, -1:].argmax(-1)], dim=1)
        return tokenizer.decode(ids[0].tolist())


def race(base, budget: float, batch_size: int, seq_len: int) -> dict:
    tokens = np.load(base / "train_tokens.npy")
    data = PackedSequences(tokens, seq_len, seed=0)
    val = PackedSequences(np.load(base / "val_tokens.npy"), seq_len).fixed_batches(4, batch_size)
    tokenizer = K3Tokenizer.load(base / "tokenizer.json")
    config = K3Config.from_preset("small", vocab_size=tokenizer.vocab_size)
    torch.manual_seed(0)
    k3 = K3Model(config)
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    llama = LlamaForCausalLM(llama_like(param_report(config)["active"], config))
    runs = [Run("K3 small", k3, QuantileBalancer(k3)), Run("Llama", llama)]
    marks = [budget, 4 * budget]
    while any(r.seconds < marks[-1] for r in runs):
        for r in runs:
            if r.seconds < marks[-1]:
                r.step(data.batch(r.steps * batch_size, batch_size))
                if len(r.val) < len(marks) and r.seconds >= marks[len(r.val)]:
                    r.val.append((r.steps, r.seconds, r.evaluate(val)))
    active = {"K3 small": param_report(config)["active"], "Llama": sum(p.numel() for p in llama.parameters())}
    return {
        "models": {
            r.name: {
                "params": sum(p.numel() for p in r.model.parameters()),
                "active": active[r.name],
                "val": r.val,
                "sample": r.sample(tokenizer),
            }
            for r in runs
        }
    }


def main() -> None:
    p = parser(NAME, __doc__)
    p.add_argument("--budget", type=float, default=None, help="B, seconds of training (default 200; 10 quick)")
    args = p.parse_args()
    out = out_dir(NAME, args)
    store = Store(out)
    budget = args.budget or (10.0 if args.quick else 200.0)
    batch_size, seq_len = (2, 64) if args.quick else (8, 256)
    result = store.run(f"race/{budget:g}", lambda: race(base_run(args.quick), budget, batch_size, seq_len))
    report(out, result, budget, batch_size, seq_len)


def report(out, result, budget, batch_size, seq_len) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    rows, samples = [], []
    for name, r in result["models"].items():
        steps, secs, loss = zip(*r["val"], strict=True)
        ax.plot(secs, loss, "o-", label=f"{name} ({r['active'] / 1e6:.1f}M active parameters)")
        cells = [f"{s} steps: {v:.3f}" for s, v in zip(steps, loss, strict=True)]
        rows.append([name, f"{r['params'] / 1e6:.2f}M / {r['active'] / 1e6:.2f}M", *cells])
        samples.append(f"{name}:\n\n```text\n{r['sample']}\n```")
    ax.set(
        xlabel="training seconds (own clock)",
        ylabel="validation loss (nats/token)",
        title=f"equal wall-clock, {batch_size}x{seq_len} tokens/step, seed 0",
    )
    ax.legend()
    save_figure(fig, out / f"{NAME}.png")
    write_tables(
        out,
        [
            (
                f"validation loss after B = {budget:g} s and 4B of training each (lockstep, seed 0)",
                ["model", "parameters / active", f"at {budget:g} s", f"at {4 * budget:g} s"],
                rows,
            )
        ],
        notes="Greedy continuations of " + repr(PROMPT) + ":\n\n" + "\n\n".join(samples),
    )


if __name__ == "__main__":
    sys.exit(main())
