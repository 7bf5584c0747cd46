"""Training memory of one forward+backward: the small K3 preset, with and without activation
checkpointing, next to the same-size HF Llama of benchmarks/train_step.py, each in a fresh process.

    python benchmarks/activation_memory.py            # 8 × 256 tokens, fp32, 2 threads
    python benchmarks/activation_memory.py --by-component    # k3's kept bytes per token by component
    python benchmarks/activation_memory.py --compiled        # also `k3 train --compile`'s step, fp32 and bf16

Reported: peak RSS growth of the process over the forward+backward (ru_maxrss after − before, after a
warm-up step on a smaller batch so allocator pools and libraries are in place), and the bytes autograd
keeps for the backward (saved-tensor hooks; for checkpointed sublayers, only their inputs).
"""

import argparse
import datetime
import json
import platform
import resource
import subprocess
import sys

import torch

from k3 import K3Config, K3Model


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def measure_sampled(system: str, batch: int, seq_len: int) -> dict:
    """A step's memory measured as a compiled one allows: two full-size steps (compile and warm up; ru_maxrss
    would keep the compiler's own peak), the freed heap back to the OS (malloc_trim), then the third step's RSS
    sampled every millisecond; reported is its peak minus the RSS before it."""
    import ctypes
    import threading
    import time

    torch.manual_seed(0)
    config = K3Config.from_preset("small")
    if system.startswith("llama"):
        from transformers import LlamaForCausalLM

        sys.path.insert(0, "benchmarks")
        from k3.model.params import param_report
        from train_step import llama_like

        model = LlamaForCausalLM(llama_like(param_report(config)["active"], config)).train()
    else:
        model = K3Model(config).train()
    forward = torch.compile(model) if "compiled" in system else model
    tokens = torch.randint(0, config.vocab_size, (batch, seq_len))
    bf16 = system.endswith("bf16")

    def step():
        model.zero_grad(set_to_none=False)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = forward(tokens, labels=tokens).loss
        loss.backward()

    step()
    step()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before, peak, done = rss_mb(), [0.0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss_mb())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    step()
    done.set()
    sampler.join()
    return {"system": system, "peak_growth_mb": peak[0] - before, "saved_mb": float("nan")}


def measure(system: str, batch: int, seq_len: int) -> dict:
    if "sampled" in system or "compiled" in system:
        return measure_sampled(system, batch, seq_len)
    torch.manual_seed(0)
    config = K3Config.from_preset("small")
    if system == "llama":
        from transformers import LlamaForCausalLM

        sys.path.insert(0, "benchmarks")
        from k3.model.params import param_report
        from train_step import llama_like

        model = LlamaForCausalLM(llama_like(param_report(config)["active"], config))
    else:
        model = K3Model(config).set_activation_checkpointing(system == "k3 + checkpointing")
    model.train()
    tokens = torch.randint(0, config.vocab_size, (batch, seq_len))

    def step(x):
        model.zero_grad(set_to_none=False)
        model(x, labels=x).loss.backward()

    step(tokens[:1, :64])  # warm-up: gradients allocated, libraries loaded
    saved = [0]

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens, labels=tokens).loss
    loss.backward()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"system": system, "peak_growth_mb": (after - before) / 1024, "saved_mb": saved[0] / 2**20}


def by_component(batch: int, seq_len: int) -> dict[str, int]:
    """Bytes autograd keeps for the backward, attributed to the innermost component running when each
    tensor is saved: KDA / MLA attention, MoE, dense FFN, the rest of a layer (AttnRes mixing, norms),
    embedding, LM head, and the loss."""
    torch.manual_seed(0)
    model = K3Model(K3Config.from_preset("small")).train()
    tags: list[str] = []

    def leave(module, inputs, output) -> None:  # a forward hook's return value would replace the output
        tags.pop()

    for layer in model.model.layers:
        parts = [
            (layer, "AttnRes mixing and norms"),
            (layer.self_attn, "KDA attention" if layer.kind == "kda" else "MLA attention"),
            (getattr(layer, "mlp", None), "dense FFN"),
            (getattr(layer, "block_sparse_moe", None), "MoE"),
        ]
        for module, name in parts:
            if module is not None:
                module.register_forward_pre_hook(lambda m, i, name=name: tags.append(name))
                module.register_forward_hook(leave)
    for module, name in [(model.model.embed_tokens, "embedding"), (model.lm_head, "LM head")]:
        module.register_forward_pre_hook(lambda m, i, name=name: tags.append(name))
        module.register_forward_hook(leave)
    kept: dict[str, int] = {}

    def pack(t):
        name = tags[-1] if tags else "loss and final norm"
        kept[name] = kept.get(name, 0) + t.numel() * t.element_size()
        return t

    tokens = torch.randint(0, model.config.vocab_size, (batch, seq_len))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens, labels=tokens).loss
    loss.backward()
    return kept


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument(
        "--compiled",
        action="store_true",
        help="also k3's compiled step, fp32 and bf16 autocast, with Llama and eager k3 measured the same way (RSS "
        "sampled over a warm step: no kept-bytes column)",
    )
    p.add_argument("--by-component", action="store_true", help="k3's kept bytes per token, by component")
    args = p.parse_args()
    torch.set_num_threads(2)
    if args.by_component:
        kept = by_component(args.batch, args.seq_len)
        tokens = args.batch * args.seq_len
        print("| component | kept KB per token | share |\n|---|---|---|")
        for name, n in sorted(kept.items(), key=lambda kv: -kv[1]):
            print(f"| {name} | {n / tokens / 1024:.1f} | {n / sum(kept.values()):.0%} |")
        print(f"| all | {sum(kept.values()) / tokens / 1024:.1f} | 100% |")
        return
    if args.one:
        print(json.dumps(measure(args.one, args.batch, args.seq_len)))
        return
    rows = []
    systems = ["llama", "k3", "k3 + checkpointing"]
    if args.compiled:
        systems += ["llama, sampled", "k3, sampled", "k3 compiled", "k3 compiled, bf16"]
    for system in systems:
        out = subprocess.run(
            [sys.executable, __file__, "--one", system, "--batch", str(args.batch), "--seq-len", str(args.seq_len)],
            capture_output=True,
            text=True,
            check=True,
        )
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    llama = rows[0]
    sampled_llama = next((r for r in rows if r["system"] == "llama, sampled"), llama)
    print(
        f"{datetime.date.today()}, {platform.machine()}, torch {torch.__version__}, fp32, 2 threads, "
        f"{args.batch} × {args.seq_len} tokens\n"
    )
    print("| system | peak RSS growth MB | ÷ Llama | kept for the backward MB | ÷ Llama |")
    print("|---|---|---|---|---|")
    for r in rows:
        sampled = "sampled" in r["system"] or "compiled" in r["system"]
        base = sampled_llama if sampled else llama  # each method against Llama measured the same way
        print(
            f"| {r['system']} | {r['peak_growth_mb']:.0f} | {r['peak_growth_mb'] / base['peak_growth_mb']:.2f} "
            f"| {r['saved_mb']:.0f} | {r['saved_mb'] / llama['saved_mb']:.2f} |"
        )


if __name__ == "__main__":
    main()
